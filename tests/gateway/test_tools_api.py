"""Tool calling through a live gateway and the official `openai` client, on SmolLM2-135M (whose template knows no
tools: they reach it the Hermes way). A model this small writes whatever it writes; the grammar makes every call
it writes valid, which is what these tests hold it to: every call names an offered function and its arguments
validate against that function's schema, in every `tool_choice`, streamed or not, and a stream reassembles into
the non-streamed answer. Bad input is a 400 naming the field, and billed nothing; the cache never serves an
answer made under other tools.

The engine here is fp32, not the shared bf16 one: a stream repeats a prompt, which hits the prefix cache and
computes its last token alone, and on a CPU with AMX bf16 matmuls change a row's bits with the row count
(tests/cpu_features.py), which flipped a near-tie between the two answers there."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from engines.async_engine import AsyncEngine
from live import LiveServer, running_engine

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city", "unit"]},
    "get_time": {"type": "object", "properties": {"city": {"type": "string"}, "hours": {"type": "integer"}},
                 "required": ["city", "hours"]},
}  # fmt: skip
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')} of a city",
                                      "parameters": schema}}
    for name, schema in SCHEMAS.items()
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]
NO_STORE = {"x-switchboard-cache-control": "no-store"}
CHOICES: list[Any] = ["auto", "required", {"type": "function", "function": {"name": "get_time"}}]


@pytest.fixture(scope="module")
def small_engine(smollm2_dir: Path) -> Iterator[AsyncEngine]:
    """SmolLM2-135M-Instruct in fp32 for this module's `live` gateway (conftest's, over this engine)."""
    with running_engine(smollm2_dir, "fp32") as engine:
        yield engine


def valid(calls: list[Any]) -> list[tuple[str, dict]]:
    """Each call's name and arguments, after checking the call against its function's schema."""
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in SCHEMAS
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str | None, list[tuple[str, dict]], str | None]:
    """A streamed answer reassembled as a client would: content, calls (index → id, name, argument pieces)."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                assert entry["id"] is None and d.function.name, "the id and the name come first, once"
                entry["id"], entry["name"] = d.id, d.function.name
            entry["arguments"] += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    parsed = [(e["name"], json.loads(e["arguments"])) for _, e in sorted(calls.items())]
    for name, args in parsed:
        jsonschema.validate(args, SCHEMAS[name])
    return content or None, parsed, reason


@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "required", "named"])
def test_every_call_is_valid_and_a_stream_reassembles_into_the_answer(client: openai.OpenAI, choice: Any) -> None:
    common: dict[str, Any] = dict(model="small", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
                                  max_tokens=96, extra_headers=NO_STORE)  # fmt: skip
    r = client.chat.completions.create(**common)
    message, reason = r.choices[0].message, r.choices[0].finish_reason
    calls = valid(message.tool_calls or [])
    if choice != "auto":
        assert calls and reason == "tool_calls" and message.content is None  # a call, and nothing else
    if isinstance(choice, dict):
        assert [name for name, _ in calls] == ["get_time"]
    assert reason in ({"tool_calls", "length"} if calls else {"stop", "length"})  # ended by itself, or cut
    assert streamed(client, **common) == (message.content, calls, reason)


def test_parallel_tool_calls_false_allows_one_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="small", messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=96)  # fmt: skip
    assert len(valid(r.choices[0].message.tool_calls)) == 1


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="small", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=24)  # fmt: skip
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_an_agent_loop_call_result_answer(live: LiveServer, client: openai.OpenAI) -> None:
    """The client's assistant turn (content null, tool_calls) and its tool results go back in; the model answers."""
    first = client.chat.completions.create(model="small", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=96)  # fmt: skip
    turn = first.choices[0].message
    results = [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": True, "value": "sunny, 21 C"})}
               for c in turn.tool_calls]  # fmt: skip
    history = [*ASK, turn.model_dump(exclude_none=True), *results]
    assert history[1]["role"] == "assistant" and "content" not in history[1]
    final = client.chat.completions.create(model="small", messages=history, tools=TOOLS, temperature=0, max_tokens=24)
    answer = final.choices[0].message
    assert answer.content or valid(answer.tool_calls)  # text, or another valid call
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens - 1  # it all went in
    for r in (first, final):
        (row,) = live.wait_for_usage(r.id)
        assert row.status == "ok" and row.completion_tokens == r.usage.completion_tokens


def test_the_cache_never_answers_under_other_tools(client: openai.OpenAI) -> None:
    def ask(tools: list[Any]) -> tuple[str, Any]:
        raw = client.chat.completions.with_raw_response.create(
            model="small", messages=ASK, tools=tools, tool_choice="required", temperature=0, max_tokens=64
        )
        return raw.headers["x-switchboard-cache"], raw.parse().choices[0].message.tool_calls

    renamed = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "weather_now"}}, TOOLS[1]]
    assert ask(TOOLS)[0] == "miss"
    hit, calls = ask(TOOLS)
    assert hit == "hit" and valid(calls)
    status, other = ask(renamed)
    assert status == "miss" and {c.function.name for c in other} <= {"weather_now", "get_time"}
    assert ask([TOOLS[1]])[0] == "miss"  # fewer tools: another answer too


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "unique"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice",
     "get_date"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$ref": "#/x"}}}]},
     "tools", "tools[0] (`f`)"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"tools": TOOLS, "messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "messages[1].tool_call_id", "no earlier call"),
    ({"tools": TOOLS, "messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "says"), BAD, ids=[b[1] for b in BAD])
def test_bad_tool_input_is_a_400_naming_the_field_and_bills_nothing(
    live: LiveServer, extra: dict[str, Any], param: str, says: str
) -> None:
    key = live.new_key()
    body = {"model": "small", "messages": ASK, **extra}
    r = httpx.post(
        f"{live.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert live.usage_rows(request_id=r.headers.get("x-request-id", "none")) == []
