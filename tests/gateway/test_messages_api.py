"""Anthropic's Messages API on a live gateway, through the official `anthropic` client, on SmolLM2-135M in fp32
(see test_responses_api for why not bf16 here).

Held: the client's own stream parser (`messages.stream`) reassembles the non-streamed message; tools come back as
`tool_use` blocks whose `input` validates, and a `tool_result` goes back in; stop reasons (`max_tokens`,
`stop_sequence` naming it, `tool_use`); `count_tokens` is the prompt the message was billed for; the key works as
`x-api-key` and as a bearer token; bad input is a 400 in Anthropic's error shape, billed nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from engines.async_engine import AsyncEngine
from live import LiveServer, running_engine

anthropic = pytest.importorskip("anthropic")

NO_STORE = {"x-switchboard-cache-control": "no-store"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[Any] = [{"name": "get_weather", "description": "the weather in a city", "input_schema": WEATHER}]
GREEDY = {"temperature": 0}  # the client has no `temperature` argument any more; the API still takes it
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def small_engine(smollm2_dir: Path) -> Iterator[AsyncEngine]:
    with running_engine(smollm2_dir, "fp32") as engine:
        yield engine


@pytest.fixture
def claude(live: LiveServer) -> Any:
    return anthropic.Anthropic(base_url=live.base_url, api_key=live.new_key(), max_retries=0, timeout=120)


def sum_input(message: Any) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def streamed(claude: Any, **kwargs: Any) -> Any:
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in final.content if b.type == "text")
    return final


@pytest.mark.parametrize("max_tokens", [6, 48])
def test_a_stream_reassembles_into_the_message(live: LiveServer, claude: Any, max_tokens: int) -> None:
    ask = [{"role": "user", "content": "Name three colors."}]
    common: dict[str, Any] = dict(model="small", max_tokens=max_tokens, system="Be brief.", extra_body=GREEDY,
                                  messages=ask, extra_headers=NO_STORE)  # fmt: skip
    whole = claude.messages.create(**common)
    assert whole.type == "message" and whole.role == "assistant" and whole.content[0].type == "text"
    cut = whole.usage.output_tokens == max_tokens
    assert whole.stop_reason == ("max_tokens" if cut else "end_turn")
    final = streamed(claude, **common)
    assert final.model_dump(exclude={"id", "usage"}) == whole.model_dump(exclude={"id", "usage"})
    # the same prompt and answer; the second one's prompt is partly served by the prefix cache
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert sum_input(final) == sum_input(whole) and final.usage.cache_read_input_tokens > 0
    (row,) = live.wait_for_usage(whole.id)
    assert row.endpoint == "messages" and row.completion_tokens == whole.usage.output_tokens
    assert row.prompt_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_a_stop_sequence_is_named(claude: Any) -> None:
    r = claude.messages.create(model="small", max_tokens=64, extra_body=GREEDY, stop_sequences=["e"],
                               messages=[{"role": "user", "content": "Write the word blue."}])  # fmt: skip
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "e") and "e" not in r.content[0].text


def test_tool_use_and_a_tool_result_round_trip(claude: Any) -> None:
    ask: dict[str, Any] = dict(model="small", max_tokens=96, extra_body=GREEDY, tools=TOOLS, messages=ASK,
                               tool_choice={"type": "any"})  # fmt: skip
    first = claude.messages.create(**ask, extra_headers=NO_STORE)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and first.stop_reason == "tool_use"
    for use in uses:
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, WEATHER)
    again = streamed(claude, **ask, extra_headers=NO_STORE)
    assert [(b.name, b.input) for b in again.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny, 21 C"} for u in uses]
    history = [*ASK, {"role": "assistant", "content": [u.model_dump() for u in uses]},
               {"role": "user", "content": results}]  # fmt: skip
    answer = claude.messages.create(model="small", max_tokens=24, extra_body=GREEDY, tools=TOOLS, messages=history)
    assert answer.content and answer.usage.input_tokens + answer.usage.cache_read_input_tokens > (
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    )


def test_count_tokens_is_the_prompt_a_message_is_billed_for(claude: Any) -> None:
    for tools in (None, TOOLS):
        extra = {"tools": tools} if tools else {}
        counted = claude.messages.count_tokens(model="small", messages=ASK, system="Be brief.", **extra)
        r = claude.messages.create(model="small", max_tokens=1, messages=ASK, system="Be brief.", **extra)
        assert counted.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens > 0


def test_the_key_works_as_x_api_key_or_bearer_and_errors_are_anthropics(live: LiveServer) -> None:
    key, url = live.new_key(), f"{live.base_url}/v1/messages"
    body = {"model": "small", "max_tokens": 1, "messages": ASK}
    for headers in ({"x-api-key": key, "anthropic-version": "2023-06-01"}, {"Authorization": f"Bearer {key}"}):
        assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200
    r = httpx.post(url, json=body, headers={"x-api-key": "sk-sb-nope"}, timeout=60)
    assert r.status_code == 401 and r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=live.base_url, api_key="sk-sb-nope", max_retries=0).messages.create(**body)
    r = httpx.post(url, json={**body, "model": "no-such-tier"}, headers={"x-api-key": key}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


BAD: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [*ASK, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, "toolu_x"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}]},
     "schema"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "says"), BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_a_400_in_anthropics_shape_and_bills_nothing(
    live: LiveServer, extra: dict[str, Any], says: str
) -> None:
    body = {k: v for k, v in {"model": "small", "max_tokens": 8, "messages": ASK, **extra}.items() if v is not None}
    r = httpx.post(f"{live.base_url}/v1/messages", json=body, headers={"x-api-key": live.new_key()}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert says in r.json()["error"]["message"], r.text
    assert live.usage_rows(request_id=r.headers.get("x-request-id", "none")) == []
