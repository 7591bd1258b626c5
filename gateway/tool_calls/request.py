"""A chat request's tools, checked, and its conversation as a chat template reads it.

Refused with a 400 naming the field: two tools with one name, a `tool_choice` naming a function not in `tools`
(or `required`/a name with no tools), a `tool` turn without the id of an earlier call it answers, and an earlier
call whose `arguments` are not a JSON object. (A schema the grammar compiler cannot use is refused where the
grammar is compiled, `gateway.pipeline.prompts`.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from gateway.http.errors import invalid
from gateway.http.schemas import ChatCompletionRequest, ChatMessage, Tool
from router_model.kinds import TOOLS_NOTE


def function_tool(function: Mapping[str, Any], where: str, names: Mapping[str, str] | None = None) -> Tool:
    """Another API's function tool as chat's `Tool` (its unset fields left out), or a 400 naming the bad field in
    that API's words: `where` is the tool's place (`tools[2]`), `names` the chat field → its own field name."""
    try:
        return Tool.model_validate(
            {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [(names or {}).get(str(p), str(p)) for p in first["loc"] if p != "function"]
        param = ".".join([where, *loc])
        raise invalid(f"{param}: {first['msg']}", param=param, code="invalid_value") from None


@dataclass(frozen=True)
class ToolRequest:
    """Tools the model may call, as OpenAI's JSON, and how (`auto`, `required` or a named function)."""

    tools: tuple[dict[str, Any], ...]
    choice: str | dict[str, Any]
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)


def tool_request(body: ChatCompletionRequest) -> ToolRequest | None:
    """The request's tools, checked; None when the model may not call any (no tools, or `tool_choice: none`)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice: Any = body.tool_choice
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise invalid(f"Tool names must be unique; {', '.join(twice)} appears more than once.", param="tools")
    if choice is not None and not isinstance(choice, str):
        if not tools:
            raise invalid("`tool_choice` names a function but no `tools` are given.", param="tool_choice")
        if choice.function.name not in names:
            raise invalid(
                f"`tool_choice` names `{choice.function.name}`, which is not in `tools` ({', '.join(names)}).",
                param="tool_choice",
            )
        choice = choice.model_dump()
    if choice == "required" and not tools:
        raise invalid("`tool_choice: required` needs `tools`.", param="tool_choice")
    _check_history(body.messages)
    if not tools or choice == "none":
        return None
    return ToolRequest(tuple(tools), choice or "auto", body.parallel_tool_calls is not False)


def _check_history(messages: list[ChatMessage]) -> None:
    called: set[str] = set()
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls or []):
            if m.role != "assistant":
                raise invalid("Only assistant turns carry `tool_calls`.", param=f"messages[{i}].tool_calls")
            try:
                args = json.loads(call.function.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise invalid(
                    "A call's `arguments` must be a JSON object, as a string.",
                    param=f"messages[{i}].tool_calls[{j}].function.arguments",
                )
            called.add(call.id)
        if m.role == "tool" and m.tool_call_id not in called:
            what = "has no `tool_call_id`" if m.tool_call_id is None else f"answers `{m.tool_call_id}`, no earlier call"
            raise invalid(
                f"A `tool` turn must answer an earlier assistant turn's call; this one {what}.",
                param=f"messages[{i}].tool_call_id",
            )


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as plain turns for a chat template: `developer` is the system turn, an assistant turn's
    calls carry their arguments as objects (templates render them with `tojson`), and a `tool` turn its call id."""
    out: list[dict[str, Any]] = []
    for m in body.messages:
        turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in m.tool_calls
            ]  # fmt: skip
        if m.role == "tool":
            turn["tool_call_id"] = m.tool_call_id
        out.append(turn)
    return out


def routing_turns(tools: ToolRequest | None) -> list[dict[str, str]]:
    """What the router reads of the tools: a system turn saying that tools are offered, how many, and their names
    (`model: "auto"` routes on it with the conversation)."""
    if tools is None:
        return []
    names = ", ".join(sorted(tools.names))
    return [{"role": "system", "content": f"{TOOLS_NOTE} {len(tools.tools)} tools: {names}."}]
