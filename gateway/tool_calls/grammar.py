"""The structural tag (xgrammar) that keeps a tool-calling answer well formed, per `tool_choice`:

    auto      free text until one of the format's triggers (`<tool_call>`, or a ```json fence, which small models
              write instead); from there the call must be
              `<tool_call>\\n{"name": "<an offered name>", "arguments": <that function's schema>}\\n</tool_call>`
              (or the same in the fence), then free text again (or not, with `parallel_tool_calls: false`)
    required  the answer is one or more such calls and nothing else
    named     the answer is exactly one call to that function

A call can then never be malformed: no invalid JSON, no unknown name, no missing required argument, no wrong
type. JSON inside a call allows at most one whitespace character in a row (`MAX_SPACE`): the model's own
`{"a": 1, "b": 2}` spacing stays possible, runs of whitespace (where small models loop) do not.
"""

from __future__ import annotations

from typing import Any

from gateway.tool_calls.formats import Opener, ToolFormat

MAX_SPACE = 1
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _tag(fmt: ToolFormat, opener: Opener, name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": f"{opener.begin}{name}{fmt.args_begin}",
        "content": {"type": "json_schema", "json_schema": parameters or ANY_OBJECT, "max_whitespace_cnt": MAX_SPACE},
        "end": opener.end,
    }


def structural_tag(
    fmt: ToolFormat, tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool
) -> dict[str, Any]:
    """The structural tag for `tools` (OpenAI's shape) under `choice` (`auto`, `required`, or a named function)."""
    functions = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    own = fmt.openers[0]
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return {"type": "structural_tag", "format": _tag(fmt, own, name, functions[name])}
    if choice == "required":  # calls only, in the model's own form: one, or several a newline apart
        tags = [_tag(fmt, own, name, parameters) for name, parameters in functions.items()]
        separated = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                     "stop_after_first": not parallel}  # fmt: skip
        return {"type": "structural_tag", "format": separated}
    tags = [_tag(fmt, o, name, parameters) for o in fmt.openers for name, parameters in functions.items()]
    triggered = {
        "type": "triggered_tags",
        "triggers": [o.trigger for o in fmt.openers],
        "tags": tags,
        "stop_after_first": not parallel,
    }
    return {"type": "structural_tag", "format": triggered}
