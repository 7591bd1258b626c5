"""A Responses API request → the `ChatCompletionRequest` the one pipeline runs, and its input as stored items.

Input items become chat turns in order: a `message` its role's turn (its text parts joined), consecutive
`function_call`s the tool calls of one assistant turn (with the text before them), a `function_call_output` a
`tool` turn answering its call, which must be in the conversation; `reasoning` items are dropped (the tiers'
models do not reason). The context of `previous_response_id` goes first, `instructions` (this turn's only)
before everything. Anything else is a 400 naming the item (`input[3]`) and what it holds.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ValidationError

from gateway.api.responses.protocol import MAX_INPUT_ITEMS, ResponsesRequest
from gateway.http.errors import invalid
from gateway.http.schemas import ChatCompletionRequest, ChatMessage, Tool
from gateway.tool_calls import function_tool

__all__ = ["chat_request", "input_items", "item_id"]

_TEXT_PARTS = ("input_text", "output_text")
_ROLES = ("user", "assistant", "system", "developer")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This turn's input as stored items (each with an id), checked; `reasoning` items dropped."""
    raw = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if len(raw) > MAX_INPUT_ITEMS:
        raise invalid(f"input: at most {MAX_INPUT_ITEMS} items", param="input")
    items = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{i}]"
        if kind == "message":
            items.append(_message(item, where))
        elif kind == "function_call":
            call = {k: _text(item, k, where) for k in ("call_id", "name", "arguments")}
            items.append({"type": "function_call", "id": item_id("fc"), **call, "status": "completed"})
        elif kind == "function_call_output":
            output = _output(item.get("output"), f"{where}.output")
            items.append(
                {
                    "type": "function_call_output",
                    "id": item_id("fco"),
                    "call_id": _text(item, "call_id", where),
                    "output": output,
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise invalid(
                f"{where}: input items of type {kind!r} are not supported; send `message`, `function_call`"
                " or `function_call_output` items.",
                param=f"{where}.type",
                code="unsupported_item",
            )
    return items


def chat_request(
    body: ResponsesRequest, context: list[dict[str, Any]], items: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that answers `body` after `context` (a previous response's conversation)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    calls: set[str] = set()
    for n, item in enumerate([*context, *items]):
        where = f"input[{n - len(context)}]"
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the text before the calls, or an earlier call
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output":
            if item["call_id"] not in calls:
                raise invalid(
                    f"{where}: no function call with call_id {item['call_id']!r} comes before this output.",
                    param=f"{where}.call_id",
                    code="unknown_call_id",
                )
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    if not messages:
        raise invalid("input: at least one item is needed.", param="input")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": [_chat_message(m) for m in messages],
        "stream": body.stream,
    }
    for field in ("temperature", "top_p", "user", "parallel_tool_calls"):
        if (value := getattr(body, field)) is not None:
            chat[field] = value
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.include and "message.output_text.logprobs" in body.include:
        chat |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
    if body.tools:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    if body.text is not None and body.text.format.type != "text":
        chat["response_format"] = _response_format(body)
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # the parts were checked one by one: what is left is a field's range
        first = exc.errors()[0]
        raise invalid(f"{'.'.join(map(str, first['loc']))}: {first['msg']}", code="invalid_value") from None


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise invalid(f"{where}.role: must be one of {', '.join(_ROLES)}", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _TEXT_PARTS or kind == "refusal":
                parts.append(
                    {
                        "type": kind if kind != "refusal" else "output_text",
                        "text": _text(part, "text" if kind != "refusal" else "refusal", at),
                    }
                )
            else:
                raise invalid(
                    f"{at}: content parts of type {kind!r} are not supported (text only: `input_text`, `output_text`).",
                    param=f"{at}.type",
                    code="unsupported_content",
                )
    else:
        raise invalid(f"{where}.content: must be a string or a list of content parts", param=f"{where}.content")
    return {"type": "message", "id": item_id("msg"), "role": role, "content": parts}


def _text(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and key != "text" and not value):
        raise invalid(f"{where}.{key}: a string is required", param=f"{where}.{key}")
    return value


def _output(value: Any, where: str) -> str:
    """A call's output: a string, or text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in value):
        return "".join(_text(p, "text", where) for p in value)
    raise invalid(f"{where}: must be a string or a list of `input_text` parts", param=where)


def _chat_message(message: dict[str, Any]) -> ChatMessage:
    try:
        return ChatMessage.model_validate(message)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise invalid(f"input: {first['msg']}", param="input", code="invalid_value") from None


def _tool(tool: dict[str, Any], where: str) -> Tool:
    kind = tool.get("type")
    if kind != "function":
        raise invalid(
            f"{where}: tools of type {kind!r} are not supported here; only `function` tools are.",
            param=f"{where}.type",
            code="unsupported_tool",
        )
    return function_tool({k: tool.get(k) for k in ("name", "description", "parameters", "strict")}, where)


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str) and choice["name"]:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid(
        f"tool_choice: {choice.get('type')!r} is not supported; send none, auto, required or "
        '{"type": "function", "name": ...}',
        param="tool_choice",
    )


def _response_format(body: ResponsesRequest) -> dict[str, Any]:
    assert body.text is not None
    f = body.text.format
    if f.type == "json_object":
        return {"type": "json_object"}
    if f.schema_ is None:
        raise invalid("text.format.schema: required when type is json_schema", param="text.format.schema")
    schema = {"name": f.name or "response", "schema": f.schema_, "strict": f.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}
