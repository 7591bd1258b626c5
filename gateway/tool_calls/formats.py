"""How a model family writes tool calls: what opens and closes a call, what a call's JSON looks like, and how
tools reach a template that does not render them itself.

Hermes (Qwen2.5, Qwen3, Hermes, and our fallback for templates with no tool support, such as SmolLM2's):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, free text around them. Small models often write the same object in a fenced ```json block
instead (both Qwen2.5-Coder tiers did on every BFCL question tried unconstrained), so the parser also takes a
fenced block whose JSON is a call (or a list of calls) to an offered function; one that is not stays text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fence:
    """Text that opens a call and text that closes it."""

    begin: str
    end: str


@dataclass(frozen=True)
class Opener:
    """How the grammar writes a call: `begin` + name + the format's `args_begin` + arguments + `end`; `trigger`
    (the start of `begin`) is what switches a lazily constrained (`auto`) output into a call."""

    trigger: str
    begin: str
    end: str


@dataclass(frozen=True)
class ToolFormat:
    name: str
    fences: tuple[Fence, ...]  # what the parser takes as a call, the model's own first
    openers: tuple[Opener, ...]  # what the grammar constrains: the model's own (forced calls use it), then others
    args_begin: str  # between the name and the arguments
    arguments_keys: tuple[str, ...] = ("arguments", "parameters")  # where a parsed call may hold its arguments


HERMES = ToolFormat(
    name="hermes",
    fences=(Fence("<tool_call>", "</tool_call>"), Fence("```json", "```")),
    # In `auto`, a fenced block is a call too, and held to the same schema as a tagged one.
    openers=(Opener("<tool_call>", '<tool_call>\n{"name": "', "}\n</tool_call>"),
             Opener("```json", '```json\n{"name": "', "}\n```")),
    args_begin='", "arguments": ',
)  # fmt: skip

FORMATS = {f.name: f for f in (HERMES,)}


def format_for(chat_template: str | None) -> ToolFormat:
    """The family a chat template writes calls in. Hermes is the only one served yet, and the fallback: a template
    that names no tool format gets tools the Hermes way (`fallback_messages`)."""
    return HERMES


def renders_tools(chat_template: str | None) -> bool:
    """Whether the template itself renders `tools` (Qwen2.5's does; SmolLM2's ignores them)."""
    return bool(chat_template) and "tools" in str(chat_template)


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` (as `request.template_messages` writes them) for a template that does not render tools: the
    Hermes tools block (Qwen2.5's own wording) in the system turn when there are tools, earlier calls as
    `<tool_call>` text and tool results as user turns in `<tool_response>`."""
    block = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    instructions = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{block}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    out: list[dict[str, Any]] = []
    if tools and messages and messages[0]["role"] == "system":
        out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{instructions}"})
        messages = messages[1:]
    elif tools:
        out.append({"role": "system", "content": instructions})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [f"<tool_call>\n{_call_json(c['function'])}\n</tool_call>" for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content") or "", *calls]))})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def _call_json(function: dict[str, Any]) -> str:
    return json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
