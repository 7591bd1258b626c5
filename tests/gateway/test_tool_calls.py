"""Tool calls without a server: the Hermes parser (whole and streamed), the tools' rendering for templates with and
without tool support, and the structural tags' grammar on the real tokenizers (every case also has the output the
grammar must refuse)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from engines.structured import GrammarCompiler, GrammarError
from engines.tokenizer import Tokenizer
from gateway.tool_calls import HERMES, CallSpec, fallback_messages, parse_answer, renders_tools, structural_tag

SPEC = CallSpec(HERMES, frozenset({"get_weather", "get_time"}))
WEATHER = {"city": "Paris", "unit": "c"}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "hours": {"type": "integer"}},
        "required": ["city", "hours"]}}},
]  # fmt: skip


def call(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


ANSWERS = [  # (model output, content, [(name, arguments)])
    (call("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    (f"Let me check.\n{call('get_weather', WEATHER)}\n{call('get_time', {'city': 'Tokyo', 'hours': 9})}\n",
     "Let me check.", [("get_weather", WEATHER), ("get_time", {"city": "Tokyo", "hours": 9})]),
    (f'```json\n{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}\n```', None, [("get_weather", WEATHER)]),
    ('```json\n[{"name": "get_time", "parameters": {"city": "Oslo", "hours": 1}}]\n```', None,
     [("get_time", {"city": "Oslo", "hours": 1})]),  # a list, and llama's `parameters`
    ('Here is JSON:\n```json\n{"city": "Paris"}\n```\nDone.', 'Here is JSON:\n```json\n{"city": "Paris"}\n```\nDone.',
     []),  # a fenced block that is no call is text
    (call("delete_everything", {}), call("delete_everything", {}), []),  # not an offered function: text
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', '<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Par', []),  # cut by max_tokens: text
    ("A plain answer  with <tool_ and trailing space ", "A plain answer  with <tool_ and trailing space ", []),
    (f"{call('get_time', {'city': 'Rome', 'hours': 2})}\n\nIt is two.", "It is two.",
     [("get_time", {"city": "Rome", "hours": 2})]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), ANSWERS)
def test_hermes_answers_parse_into_content_and_calls(text: str, content: str | None, calls: list) -> None:
    got_content, got = parse_answer(text, SPEC)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


@pytest.mark.parametrize(("text", "content", "calls"), ANSWERS)
def test_a_stream_cut_anywhere_reassembles_into_the_whole_answer(text: str, content: str | None, calls: list) -> None:
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        parser = SPEC.parser()
        streamed, got = "", []
        for piece in pieces:
            out = parser.feed(piece)
            streamed, got = streamed + out.content, got + out.calls
        last = parser.finish()
        streamed, got = streamed + last.content, got + last.calls
        assert (streamed or None if got else streamed) == content
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.fixture(scope="module")
def tokenizers(smollm2_dir: Path, qwen05_dir: Path) -> dict[str, Tokenizer]:
    return {"smollm2": Tokenizer(smollm2_dir), "qwen": Tokenizer(qwen05_dir)}


def test_tools_render_through_the_template_or_the_hermes_fallback(tokenizers: dict[str, Tokenizer]) -> None:
    qwen, smol = tokenizers["qwen"], tokenizers["smollm2"]
    assert renders_tools(qwen.chat_template) and not renders_tools(smol.chat_template)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]  # fmt: skip
    native = qwen.render_chat(history, TOOLS)
    fallback = smol.render_chat(fallback_messages(history, TOOLS))
    for text in (native, fallback):  # the same Hermes conversation either way
        assert '"name": "get_time"' in text and "<tools>" in text
        assert call("get_weather", WEATHER) in text
        assert "<tool_response>\nsunny\n</tool_response>" in text
    assert qwen.render_chat(history[:1]) != qwen.render_chat(history[:1], TOOLS)


def run(grammar: Any, tokenizer: Tokenizer, text: str) -> bool:
    """Whether the grammar accepts `text` followed by the end of the turn."""
    matcher = grammar.constraint()
    ids = [*tokenizer.encode(text, add_special_tokens=False), min(tokenizer.eos_token_ids)]
    try:
        for i in ids:
            matcher.accept(i)
    except RuntimeError:
        return False
    return matcher.complete


@pytest.mark.parametrize("name", ["smollm2", "qwen"])
def test_the_structural_tags_accept_calls_and_refuse_malformed_ones(
    name: str, tokenizers: dict[str, Tokenizer]
) -> None:
    tok = tokenizers[name]
    compiler = GrammarCompiler(tok, tok.hf.vocab_size if name == "smollm2" else 151936)
    good = call("get_time", {"city": "Tokyo", "hours": 9})
    malformed = [
        call("get_date", {"city": "Tokyo"}),  # no such function
        call("get_time", {"city": "Tokyo"}),  # a required argument missing
        call("get_time", {"city": "Tokyo", "hours": "nine"}),  # the wrong type
        '<tool_call>\n{"name": "get_time", "arguments": {"city": "Tokyo", "hours": 9}',  # not closed
        '<tool_call>\n{"name": "get_time", "arguments": {"city":  "Tokyo", "hours": 9}}\n</tool_call>',  # 2 spaces
    ]
    auto = compiler.structural_tag(structural_tag(HERMES, TOOLS, "auto", parallel=True))
    assert run(auto, tok, good) and run(auto, tok, "No call needed.") and run(auto, tok, f"Sure.\n{good}\n{good}")
    assert not any(run(auto, tok, bad) for bad in malformed)
    fenced = '```json\n{"name": "get_time", "arguments": {"city": "Tokyo", "hours": 9}}\n```'
    assert run(auto, tok, fenced)  # the fenced form small models write is held to the same schema...
    assert not run(auto, tok, fenced.replace("9}", '"9"}'))
    assert not run(auto, tok, '```json\n{"city": "Tokyo"}\n```')  # ...so, with tools, a fence holds a call
    required = compiler.structural_tag(structural_tag(HERMES, TOOLS, "required", parallel=True))
    assert run(required, tok, good) and run(required, tok, f"{good}\n{call('get_weather', WEATHER)}")
    assert not run(required, tok, "No call needed.") and not run(required, tok, f"Sure. {good}")
    single = compiler.structural_tag(structural_tag(HERMES, TOOLS, "required", parallel=False))
    assert run(single, tok, good) and not run(single, tok, f"{good}\n{good}")
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = compiler.structural_tag(structural_tag(HERMES, TOOLS, named, parallel=True))
    assert run(forced, tok, call("get_weather", WEATHER)) and not run(forced, tok, good)
    route = {"type": "object", "properties": {"start": {"type": "string"}, "end": {"type": "string"}},
             "required": ["start", "end"]}  # fmt: skip
    ordered = compiler.structural_tag(structural_tag(HERMES, [{"type": "function", "function": {
        "name": "route", "parameters": route}}], "required", parallel=True))  # fmt: skip
    assert run(ordered, tok, call("route", {"start": "A", "end": "B"}))  # in the schema's order, as the model reads it
    assert not run(ordered, tok, call("route", {"end": "B", "start": "A"}))
    with pytest.raises(GrammarError):
        bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$ref": "#/nope"}}}]
        compiler.structural_tag(structural_tag(HERMES, bad, "auto", parallel=True))
