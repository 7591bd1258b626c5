"""An Anthropic Messages request → the `ChatCompletionRequest` the one pipeline runs.

`system` (a string or text blocks) is the first turn. A user message's `tool_result` blocks become `tool` turns
answering their `tool_use_id` (which an earlier assistant `tool_use` must carry; `is_error` results are marked
`[error]`), its text blocks a user turn; an assistant message's text and `tool_use` blocks one assistant turn with
tool calls (`input` as the arguments' JSON). `thinking` blocks are dropped; images and documents are a 400 naming
the block. `tool_choice`: auto, any (= required), tool (a named function), none; `disable_parallel_tool_use`
allows one call.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from gateway.api.messages.protocol import CountTokensRequest, MessagesRequest
from gateway.http.errors import invalid
from gateway.http.schemas import ChatCompletionRequest, Tool
from gateway.tool_calls import function_tool

__all__ = ["chat_request"]

_DROPPED = ("thinking", "redacted_thinking")


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else _texts(body.system, "system")
        messages.append({"role": "system", "content": system})
    calls: set[str] = set()
    for i, message in enumerate(body.messages):
        messages += _turns(message, f"messages[{i}]", calls)
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if isinstance(body, MessagesRequest):
        chat |= {"max_tokens": body.max_tokens, "stream": body.stream}
        for field in ("temperature", "top_p", "top_k"):
            if (value := getattr(body, field)) is not None:
                chat[field] = value
        if body.stop_sequences is not None:
            chat["stop"] = body.stop_sequences
        if body.metadata is not None and body.metadata.user_id is not None:
            chat["user"] = body.metadata.user_id
    if body.tools:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat |= _tool_choice(body.tool_choice)
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # a block's text or a call's shape: say which message
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        param = f"messages[{loc[1]}]" if loc[:1] == ["messages"] and len(loc) > 1 else ".".join(loc)
        raise invalid(f"{param}: {first['msg']}", param=param, code="invalid_value") from None


def _turns(message: dict[str, Any], where: str, calls: set[str]) -> list[dict[str, Any]]:
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise invalid(f"{where}.role: must be user or assistant", param=f"{where}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content: must be a string or a list of content blocks", param=f"{where}.content")
    turns: list[dict[str, Any]] = []
    text, tool_calls = "", []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text += _text(block, at)
        elif kind == "tool_use" and role == "assistant":
            tool_calls.append(_call(block, at))
            calls.add(block["id"])
        elif kind == "tool_result" and role == "user":
            turns.append(_result(block, at, calls))
        elif kind in _DROPPED:
            continue
        else:
            raise invalid(
                f"{at}: content blocks of type {kind!r} are not supported in a {role} message here "
                "(text, tool_use and tool_result are).",
                param=f"{at}.type",
                code="unsupported_content",
            )
    if role == "assistant":
        return [{"role": "assistant", "content": text or None, **({"tool_calls": tool_calls} if tool_calls else {})}]
    return [*turns, *([{"role": "user", "content": text}] if text or not turns else [])]


def _text(block: dict[str, Any], at: str) -> str:
    if not isinstance(block.get("text"), str):
        raise invalid(f"{at}.text: a string is required", param=f"{at}.text")
    return block["text"]


def _texts(blocks: list[dict[str, Any]], where: str) -> str:
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise invalid(f"{where}[{j}]: only text blocks are supported here", param=f"{where}[{j}].type")
    return "".join(_text(b, f"{where}[{j}]") for j, b in enumerate(blocks))


def _call(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not block["id"] or not isinstance(block.get("name"), str):
        raise invalid(f"{at}: a tool_use block needs an `id` and a `name`", param=at)
    if not isinstance(block.get("input"), dict):
        raise invalid(f"{at}.input: must be an object", param=f"{at}.input")
    arguments = json.dumps(block["input"], ensure_ascii=False)
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def _result(block: dict[str, Any], at: str, calls: set[str]) -> dict[str, Any]:
    use_id = block.get("tool_use_id")
    if use_id not in calls:
        raise invalid(
            f"{at}.tool_use_id: no earlier tool_use has the id {use_id!r}.",
            param=f"{at}.tool_use_id",
            code="unknown_tool_use_id",
        )
    content = block.get("content", "")
    text = (
        content if isinstance(content, str) else _texts(content, f"{at}.content") if isinstance(content, list) else None
    )
    if text is None:
        raise invalid(f"{at}.content: must be a string or text blocks", param=f"{at}.content")
    return {"role": "tool", "tool_call_id": use_id, "content": f"[error] {text}" if block.get("is_error") else text}


def _tool(tool: dict[str, Any], where: str) -> Tool:
    if tool.get("type", "custom") != "custom":
        raise invalid(
            f"{where}: tools of type {tool['type']!r} are not supported here; only client tools with an "
            "`input_schema` are.",
            param=f"{where}.type",
            code="unsupported_tool",
        )
    function = {
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("input_schema"),
    }
    return function_tool(function, where, {"parameters": "input_schema"})


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if kind in ("auto", "none"):
        out["tool_choice"] = kind
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise invalid(
            'tool_choice: must be auto, any, none, or {"type": "tool", "name": ...}', param="tool_choice.type"
        )
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out
