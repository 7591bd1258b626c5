"""OpenAI's Responses API on a live gateway, through the official `openai` client and the OpenAI Agents SDK on its
default settings (which speak this API), on SmolLM2-135M in fp32 (a stream repeats a prompt, which hits the prefix
cache; on AMX bf16 rows change bits with the row count, tests/cpu_features.py, and would flip near-ties).

Held: a stream's events (the client's own parser) reassemble the non-streamed response; tools come back as
`function_call` items that validate, and their outputs go back in; `json_schema` answers parse and validate;
`previous_response_id` continues a stored conversation (the prefix cache serves its growing prefix), per tenant
(another's id is a 404), until deleted; `store: false` keeps nothing; bad input is a 400 in OpenAI's shape,
billed nothing."""

from __future__ import annotations

import asyncio
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

NO_STORE = {"x-switchboard-cache-control": "no-store"}  # the response cache's: every answer is generated
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
                     "parameters": WEATHER}]  # fmt: skip
# Every answer the grammar admits is short: a cut one could not parse.
PERSON = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "tall": {"type": "boolean"}},
          "required": ["color", "tall"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def small_engine(smollm2_dir: Path) -> Iterator[AsyncEngine]:
    with running_engine(smollm2_dir, "fp32") as engine:
        yield engine


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[Any, str, list[str]]:
    """The final response of a stream, the text its deltas spell, and the event types in order."""
    final, text, types, seqs = None, "", [], []
    for event in client.responses.create(stream=True, **kwargs):
        types.append(event.type)
        seqs.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert seqs == list(range(len(seqs)))
    return final, text, types


@pytest.mark.parametrize("max_tokens", [8, 48])
def test_a_stream_reassembles_into_the_response(client: openai.OpenAI, max_tokens: int) -> None:
    common: dict[str, Any] = dict(model="small", input="Name three colors.", instructions="Be brief.",
                                  max_output_tokens=max_tokens, temperature=0, extra_headers=NO_STORE)  # fmt: skip
    whole = client.responses.create(**common)
    assert whole.id.startswith("resp") and whole.object == "response" and whole.output_text
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].annotations == []
    assert whole.usage.output_tokens > 0 and whole.usage.input_tokens > 0
    assert whole.status == ("incomplete" if whole.usage.output_tokens == max_tokens else "completed")
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    final, text, types = streamed(client, **common)
    assert text == final.output_text == whole.output_text and final.status == whole.status
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]  # fmt: skip


def test_tools_come_back_as_calls_and_their_outputs_go_back_in(live: LiveServer, client: openai.OpenAI) -> None:
    ask: dict[str, Any] = dict(model="small", input="What is the weather in Paris?", tools=TOOLS,
                               tool_choice="required", temperature=0, max_output_tokens=64)  # fmt: skip
    first = client.responses.create(**ask, extra_headers=NO_STORE)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER)
    final, _, types = streamed(client, **ask, extra_headers=NO_STORE)
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]
    assert "response.function_call_arguments.done" in types
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"} for c in calls]
    answer = client.responses.create(model="small", previous_response_id=first.id, input=outputs, tools=TOOLS,
                                     temperature=0, max_output_tokens=24)  # fmt: skip
    assert answer.output and answer.previous_response_id == first.id
    assert answer.usage.input_tokens > first.usage.input_tokens  # the first turn, its calls and their outputs went in
    (row,) = live.wait_for_usage(answer.id)
    assert row.endpoint == "responses" and row.completion_tokens == answer.usage.output_tokens


def test_json_schema_answers_validate(client: openai.OpenAI) -> None:
    r = client.responses.create(model="small", input="Describe a person as JSON.", temperature=0, max_output_tokens=64,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                 "strict": True}})  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


def test_a_chain_continues_its_stored_conversation_with_a_warm_prefix(live: LiveServer, client: openai.OpenAI) -> None:
    previous, inputs, cached = None, [], []
    for turn in range(20):  # the chain: 20 turns
        r = client.responses.create(model="small", input=f"Turn {turn}: say one word.", previous_response_id=previous,
                                    temperature=0, max_output_tokens=6, extra_headers=NO_STORE)  # fmt: skip
        inputs.append(r.usage.input_tokens)
        cached.append(r.usage.input_tokens_details.cached_tokens)
        previous = r.id
    assert inputs == sorted(inputs) and len(set(inputs)) == 20  # each turn carries the earlier ones
    # From the second turn on, the earlier turns are served by the prefix cache (the block-aligned part of them).
    assert all(c >= prev - 16 for c, prev in zip(cached[1:], inputs[:-1], strict=True)), (cached, inputs)
    got = client.responses.retrieve(previous)
    assert got.id == previous and got.previous_response_id is not None
    items = client.responses.input_items.list(previous)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Turn 19: say one word."


def test_stored_responses_are_the_tenants_own_until_deleted(live: LiveServer, client: openai.OpenAI) -> None:
    r = client.responses.create(model="small", input="Hi", max_output_tokens=4, temperature=0)
    other = openai.OpenAI(base_url=client.base_url, api_key=live.new_key(), max_retries=0)
    for call in (lambda: other.responses.retrieve(r.id), lambda: other.responses.delete(r.id),
                 lambda: other.responses.create(model="small", input="Hi", previous_response_id=r.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call()
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model="small", input="Hi", previous_response_id=r.id)
    assert gone.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unkept = client.responses.create(model="small", input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


@pytest.mark.parametrize("streamed_run", [False, True], ids=["run", "run_streamed"])
def test_the_agents_sdk_on_its_default_settings_runs_a_tool_loop(live: LiveServer, streamed_run: bool) -> None:
    """Agents SDK 0.24 speaks the Responses API by default: a function tool is called and its result answered,
    whole or streamed (the SDK reads the stream's typed events)."""
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny, 21 C"

    client = openai.AsyncOpenAI(base_url=f"{live.base_url}/v1", api_key=live.new_key(), max_retries=0)
    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(model="small", openai_client=client)
    assert agents.models._openai_shared.get_use_responses_by_default()  # the default, not switched to chat
    settings = agents.ModelSettings(tool_choice="required", max_tokens=160, temperature=0)
    agent = agents.Agent(
        name="weather", instructions="Answer with the tool.", tools=[get_weather], model=model, model_settings=settings
    )
    ask = "What is the weather in Paris?"

    async def run() -> Any:
        if not streamed_run:
            return await agents.Runner.run(agent, ask, max_turns=4)
        result = agents.Runner.run_streamed(agent, ask, max_turns=4)
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds
        return result

    result = asyncio.run(run())
    assert calls and isinstance(result.final_output, str) and result.final_output


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"input": [{"type": "computer_call", "id": "x"}]}, "input[0].type", "computer_call"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "1"}]}, "input[0].call_id",
     "call_1"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "input_image"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", "pattern"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "required"),
    ({"tool_choice": {"type": "mcp"}}, "tool_choice", "mcp"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "$ref": "#/x"}}]}, "tools",
     "tools[0] (`f`)"),  # a schema the grammar compiler cannot use
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "says"), BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_a_400_naming_the_field_and_bills_nothing(
    live: LiveServer, extra: dict[str, Any], param: str, says: str
) -> None:
    body = {"model": "small", "input": "Hi", **extra}
    r = httpx.post(f"{live.base_url}/v1/responses", json=body,
                   headers={"Authorization": f"Bearer {live.new_key()}"}, timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and says in error["message"], error
    assert live.usage_rows(request_id=r.headers.get("x-request-id", "none")) == []


def test_logprobs_come_on_the_text_part_where_include_asks(client: openai.OpenAI) -> None:
    r = client.responses.create(model="small", input="Name a color.", max_output_tokens=6, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=2)  # fmt: skip
    part = r.output[0].content[0]
    assert part.logprobs and "".join(t.token for t in part.logprobs) == part.text
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in part.logprobs)
    plain = client.responses.create(model="small", input="Name a color.", max_output_tokens=6, temperature=0)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text
