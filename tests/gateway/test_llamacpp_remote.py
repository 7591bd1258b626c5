"""A real inference server behind a remote tier: llama.cpp's OpenAI-compatible server (llama-cpp-python's, on
the SmolLM2 GGUF the registry ships) serves tier `remote` of a live gateway on PostgreSQL, whose local tier
`small` (SmolLM2 in bf16: the same vocabulary) is its fallback.

Through the gateway, greedy answers are the server's own answers to the same messages, streamed or not, with
its token counts. Killed (SIGKILL) mid-stream, the stream ends in an `engine_error` event with what ran
billed; the next requests fall back to `small` while the circuit breaker is open; restarted on the same port,
the breaker's trial call goes to it, closes the circuit, and the remote serves again. Every request is billed
exactly once. (The stub in tests/engines/test_remote_engine.py injects exact faults; this is the real thing.)
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import services
from core.db.database import Database
from core.db.models import Usage
from core.settings import Settings
from engines.async_engine import AsyncEngine
from engines.checkpoints.fetch import assemble_gguf, registry_model
from engines.remote.engine import RemoteEngine
from gateway.accounting.ledger import UsageRecord
from gateway.accounting.tenants import authenticate, create_key
from gateway.api.deps import running_pipeline
from gateway.runtime.tiers import check_fallbacks, load_remote
from live import LiveServer, start_server

_MISSING = [m for m in ("llama_cpp", "sse_starlette", "starlette_context") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(_MISSING),
        reason="needs llama.cpp's OpenAI-compatible server, llama-cpp-python[server] "
        f"({', '.join(_MISSING)} not importable)",
    ),
]

MODELS_HOME = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()
ALIAS = "smollm2"  # the model name llama.cpp's server answers to
N_CTX = 2048
TIER = "x-switchboard-tier"
NO_STORE = {"x-switchboard-cache-control": "no-store"}  # every request reaches a tier
MAX_TOKENS = 24
COOLDOWN_S = 6.0  # the breaker's: long enough to see it open (two short fallback answers), short enough to wait
SETTLE_S = 1.5  # no new ledger row or write for this long: a late duplicate would have landed
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Name the capital of France."}],
    [{"role": "user", "content": "Explain how a rainbow forms."}],  # longer than MAX_TOKENS
    [
        {"role": "system", "content": "You answer in very few words."},
        {"role": "user", "content": "What colour is the sky on a clear day?"},
    ],
]
LONG = [{"role": "user", "content": "Write a long story about a dragon who loves tea, with many details."}]


class LlamaServer(services.ServerProcess):
    """`python -m llama_cpp.server` on the SmolLM2 GGUF, one thread, on a port it keeps across restarts."""

    def __init__(self, gguf: Path, log: Path) -> None:
        super().__init__(log, "llama.cpp's server")
        self.port = services.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.gguf = gguf

    def start(self) -> None:
        # No --chat_format: the server renders the GGUF's own chat template, the one our tokenizer renders.
        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(self.gguf), "--model_alias", ALIAS,
                   "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(N_CTX), "--n_threads", "1",
                   "--n_threads_batch", "1", "--seed", "0", "--verbose", "False"]  # fmt: skip
        self.launch(command, f"{self.url}/v1/models", timeout=60)


@dataclass
class Reply:
    id: str
    text: str
    finish_reason: str | None
    usage: tuple[int, int] | None  # prompt, completion (None: a stream that reported none)
    tier: str | None  # x-switchboard-tier
    model: str
    pieces: int = 1  # streamed content chunks


def chat(client: openai.OpenAI, model: str, messages: Any, *, stream: bool, max_tokens: int = MAX_TOKENS) -> Reply:
    common: Any = dict(model=model, messages=messages, temperature=0, max_tokens=max_tokens, extra_headers=NO_STORE)
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**common)
        reply = raw.parse()
        usage = (reply.usage.prompt_tokens, reply.usage.completion_tokens) if reply.usage else None
        choice = reply.choices[0]
        return Reply(reply.id, choice.message.content or "", choice.finish_reason, usage, raw.headers.get(TIER),
                     reply.model)  # fmt: skip
    with client.chat.completions.with_streaming_response.create(
        **common, stream=True, stream_options={"include_usage": True}
    ) as response:
        tier = response.headers.get(TIER)
        chunks = list(response.parse())
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    last = chunks[-1].usage
    usage = (last.prompt_tokens, last.completion_tokens) if last else None
    return Reply(chunks[0].id, "".join(pieces), reasons[-1], usage, tier, chunks[0].model, len(pieces))


@dataclass
class Setup:
    server: LlamaServer
    direct: openai.OpenAI  # straight to llama.cpp's server
    live: LiveServer
    engine: RemoteEngine
    writes: Counter[str]  # ledger writes by request id: a duplicate the database refused would show only here

    def tenant(self) -> tuple[openai.OpenAI, int, str]:
        """A tenant: its client, id and an admin key (for the engine stats)."""
        key = self.live.new_key()
        who = authenticate(self.live.db, key)
        assert who is not None
        admin = create_key(self.live.db, who.tenant_name, "admin").key
        client = openai.OpenAI(base_url=f"{self.live.base_url}/v1", api_key=key, max_retries=0, timeout=120)
        return client, who.tenant_id, admin

    def stats(self, admin: str) -> dict[str, Any]:
        r = httpx.get(f"{self.live.base_url}/v1/engine/stats", headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 200
        return r.json()["remote"]

    def health(self) -> tuple[int, dict[str, Any]]:
        r = httpx.get(f"{self.live.base_url}/healthz")
        return r.status_code, r.json()["engines"]["remote"]

    def breaker_metric(self) -> float:
        text = httpx.get(f"{self.live.base_url}/metrics").text
        (line,) = [x for x in text.splitlines() if x.startswith('switchboard_breaker_open{tier="remote"}')]
        return float(line.rsplit(" ", 1)[1])

    def billed_once(self, tenant_id: int, request_ids: list[str]) -> dict[str, Usage]:
        """The tenant's ledger rows once every request has one and nothing was written for SETTLE_S: one row and
        one write per request, and no other row."""
        deadline = time.monotonic() + 30
        seen: tuple[int, int] | None = None
        quiet_since = time.monotonic()
        while True:
            rows = self.live.usage_rows(tenant_id=tenant_id)
            now = (len(rows), sum(self.writes.values()))
            if now != seen:
                seen, quiet_since = now, time.monotonic()
            if {r.request_id for r in rows} >= set(request_ids) and time.monotonic() - quiet_since >= SETTLE_S:
                break
            assert time.monotonic() < deadline, f"not every request was billed: {sorted(request_ids)} vs {rows}"
            time.sleep(0.05)
        assert sorted(r.request_id for r in rows) == sorted(request_ids)  # one row each, nothing else
        assert {rid: self.writes[rid] for rid in request_ids} == dict.fromkeys(request_ids, 1)
        return {r.request_id: r for r in rows}


@pytest.fixture(scope="module")
def setup(
    small_engine: AsyncEngine, smollm2_dir: Path, postgres_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    gguf = assemble_gguf(registry_model("smollm2-135m-instruct"), MODELS_HOME / "gguf", progress=False)
    workdir = tmp_path_factory.mktemp("llamacpp")
    server = LlamaServer(gguf, workdir / "llama-server.log")
    server.start()
    url, drop = services.create_database(postgres_server)
    tiers = {
        "remote": {
            "model": str(smollm2_dir),  # its tokenizer and chat template: the GGUF's own
            "url": server.url,
            "remote_model": ALIAS,
            "prompt_format": "text",  # llama-cpp-python's /v1/completions takes no token ids
            "max_model_len": N_CTX,
            "fallback": "small",
            "max_retries": 1,
            "breaker_failures": 2,
            "breaker_cooldown_s": COOLDOWN_S,
        },
        "small": {"model": str(smollm2_dir)},
    }
    settings = Settings(home=workdir / "home", database_url=url, tiers=tiers)
    engine = load_remote(settings, "remote", settings.tiers["remote"])
    engines = {"remote": engine, "small": small_engine}
    check_fallbacks(settings, engines)
    from gateway.app import create_app

    db = Database(url)
    live, stop = start_server(create_app(settings, engines=engines, database=db), db)
    writes: Counter[str] = Counter()
    pipeline = running_pipeline(live.app)
    assert pipeline is not None
    ledger, write = pipeline.ledger, pipeline.ledger.write

    async def counted(rec: UsageRecord) -> None:
        writes[rec.request_id] += 1
        await write(rec)

    ledger.write = counted  # type: ignore[method-assign]
    direct = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield Setup(server, direct, live, engine, writes)
    finally:
        stop()
        engine.shutdown()
        db.dispose()
        drop()
        server.stop()


def test_answers_through_the_remote_tier_are_llamacpps_own(setup: Setup) -> None:
    """Greedy answers through tier `remote`, streamed or not, equal llama.cpp's own answers to the same messages:
    text, finish reason and token counts (so our chat template and tokens are the ones it renders)."""
    client, tenant_id, admin = setup.tenant()
    served: list[Reply] = []
    for messages in CONVERSATIONS:
        direct = chat(setup.direct, ALIAS, messages, stream=False)
        direct_streamed = chat(setup.direct, ALIAS, messages, stream=True)
        assert direct.text and direct_streamed.text == direct.text
        for stream in (False, True):
            got = chat(client, "remote", messages, stream=stream)
            assert (got.tier, got.model) == ("remote", "remote")
            assert (got.text, got.finish_reason, got.usage) == (direct.text, direct.finish_reason, direct.usage)
            if stream:
                assert got.pieces > 1  # passed through as it was generated, not in one piece
            served.append(got)
    assert {r.finish_reason for r in served} == {"stop", "length"}  # both ways an answer ends

    rows = setup.billed_once(tenant_id, [r.id for r in served])
    for reply in served:
        row = rows[reply.id]
        assert (row.tier, row.status) == ("remote", "ok")
        assert (row.prompt_tokens, row.completion_tokens) == reply.usage
    stats = setup.stats(admin)
    assert (stats["breaker"], stats["alive"], stats["remote_failures"]) == ("closed", True, 0)


def test_killed_mid_stream_falls_back_then_the_breaker_closes(setup: Setup) -> None:
    client, tenant_id, admin = setup.tenant()
    question = CONVERSATIONS[0]
    before = chat(setup.direct, ALIAS, question, stream=False)
    ids: list[str] = []

    # 1. A long answer streams from the remote; the server is SIGKILLed once its first piece arrives. The client
    #    gets the text so far, then an error event (gateway/api/serving.py `stream`: an error after the stream
    #    started), never a finish; the row bills what ran, on the tier it ran on.
    pieces: list[str] = []
    with client.chat.completions.with_streaming_response.create(
        model="remote", messages=LONG, temperature=0, max_tokens=512, stream=True, extra_headers=NO_STORE,
        stream_options={"include_usage": True},
    ) as response:  # fmt: skip
        assert response.headers[TIER] == "remote"
        with pytest.raises(openai.APIError) as info:
            for chunk in response.parse():
                if not ids:
                    ids.append(chunk.id)
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                    if len(pieces) == 1:
                        setup.server.kill()
                assert not (chunk.choices and chunk.choices[0].finish_reason), "it finished before the kill"
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "engine_error"
    assert pieces
    killed = setup.billed_once(tenant_id, ids)[ids[0]]
    assert (killed.tier, killed.status) == ("remote", "error")
    assert killed.prompt_tokens == len(setup.engine.tokenizer.encode_chat(LONG))
    assert killed.completion_tokens >= len(pieces)

    # 2. The remote is down: the next request's call fails (the second failure in a row) and opens the
    #    breaker, so it is served by `small`; stats, health and metrics say so; the one after skips the remote.
    first = chat(client, "remote", question, stream=False, max_tokens=8)
    assert (first.tier, first.model) == ("small", "remote") and first.text
    stats = setup.stats(admin)
    assert (stats["breaker"], stats["alive"], stats["breaker_times_opened"]) == ("open", False, 1)
    assert setup.health() == (200, {"running": 0, "alive": False, "breaker": "open"})  # `small` covers it
    assert setup.breaker_metric() == 1.0
    calls = stats["remote_calls"]
    second = chat(client, "remote", question, stream=True, max_tokens=8)
    assert (second.tier, second.model) == ("small", "remote") and second.text
    assert setup.stats(admin)["remote_calls"] == calls  # the open circuit made no call
    ids += [first.id, second.id]

    # 3. Back on the same port: after the cooldown the breaker is half-open; the next request is its trial, served
    #    by the remote with its answer from before the crash, and the circuit closes.
    setup.server.start()
    deadline = time.monotonic() + COOLDOWN_S + 10
    while (state := setup.stats(admin)["breaker"]) == "open":
        assert time.monotonic() < deadline, "the breaker never went half-open"
        time.sleep(0.1)
    assert state == "half_open" and setup.health()[1]["breaker"] == "half_open"
    back = chat(client, "remote", question, stream=False)
    assert (back.tier, back.text, back.usage) == ("remote", before.text, before.usage)
    stats = setup.stats(admin)
    assert (stats["breaker"], stats["alive"], stats["breaker_times_opened"]) == ("closed", True, 1)
    assert setup.health() == (200, {"running": 0, "alive": True, "breaker": "closed"})
    assert setup.breaker_metric() == 0.0
    again = chat(client, "remote", question, stream=True)
    assert (again.tier, again.text) == ("remote", before.text)
    ids += [back.id, again.id]

    rows = setup.billed_once(tenant_id, ids)
    assert [(rows[i].tier, rows[i].status) for i in ids] == [("remote", "error"), ("small", "ok"), ("small", "ok"),
                                                             ("remote", "ok"), ("remote", "ok")]  # fmt: skip
    assert (rows[back.id].prompt_tokens, rows[back.id].completion_tokens) == before.usage


def test_tools_on_the_remote_tier_are_its_servers_answer_read_for_calls(setup: Setup) -> None:
    """Tools reach the remote tier rendered by the tier's template (SmolLM2's knows none: the Hermes block), and
    its server's text comes back read by the gateway's own parser: the same content and calls as llama.cpp's
    direct answer to that prompt, parsed the same way; billed once."""
    from gateway.http.schemas import ChatCompletionRequest
    from gateway.pipeline.prompts import chat_input
    from gateway.tool_calls import HERMES, CallSpec, parse_answer, template_messages, tool_request

    client, tenant_id, _ = setup.tenant()
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    messages = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]

    def evict() -> None:
        """llama-cpp-python keeps the last prompt's KV and re-evaluates only its last token when the same prompt
        comes again: one row through other matmul kernels than the prefill's, which flipped a near-tie on an
        AVX-512 Xeon. Another prompt first makes both answers full prefills."""
        setup.direct.completions.create(model=ALIAS, prompt="Bonjour", temperature=0, max_tokens=1)

    evict()
    got = client.chat.completions.create(model="remote", messages=messages, tools=tools, temperature=0,
                                         max_tokens=MAX_TOKENS, extra_headers=NO_STORE)  # fmt: skip
    body = ChatCompletionRequest.model_validate({"model": "remote", "messages": messages, "tools": tools})
    tokenizer = setup.engine.tokenizer
    turns, offered = chat_input(tokenizer, template_messages(body), tool_request(body))
    ids = tokenizer.encode_chat(turns, offered)
    prompt = tokenizer.backend.decode(ids, skip_special_tokens=False)  # what the gateway sends (prompt_format text)
    assert prompt == tokenizer.render_chat(turns, offered)
    evict()
    direct = setup.direct.completions.create(model=ALIAS, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    content, calls = parse_answer(direct.choices[0].text, CallSpec(HERMES, frozenset({"get_weather"})))
    message = got.choices[0].message
    assert message.content == content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        (c.name, c.arguments) for c in calls
    ]
    assert setup.billed_once(tenant_id, [got.id])[got.id].tier == "remote"
