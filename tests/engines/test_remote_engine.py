"""Remote tiers: `RemoteEngine` against real HTTP servers, and fallback through a live gateway.

A stub completions server in this process shows retries before the first token (and none after
it), the circuit breaker and the request body. A second switchboard process serving SmolLM2 is the
remote behind tier `remote` of a gateway whose local tier `small` (the same model) is its fallback:
its answers equal the local engine's, its 400 is ours, killing it falls back with no 5xx, and once it
is back the breaker closes again.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import services
from core.db.database import Database
from core.db.models import Usage
from core.settings import Settings, TierSettings
from engines.async_engine import AsyncEngine
from engines.protocol import EngineUnavailable, RequestRejected
from engines.remote.circuit_breaker import CircuitBreaker
from engines.remote.engine import RemoteConfig, RemoteEngine
from engines.request import EngineRequest, FinishReason, RequestOutput
from engines.sampling import SamplingParams
from gateway.accounting.tenants import authenticate, create_key
from gateway.api.deps import app_services
from gateway.runtime.tiers import check_fallbacks, load_remote
from live import LiveServer, run_in_thread, start_server
from policies.policy import Policy
from policies.pricing import Tokens, charge
from tiny import tiny_hf_model

MODELS_HOME = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()  # as conftest's
SWITCHBOARD = Path(sys.executable).parent / "switchboard"


# --- the circuit breaker -----------------------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_and_probes_with_one_trial() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failures=3, cooldown_s=10.0, clock=lambda: now[0])
    assert breaker.state == "closed" and breaker.admit() == "call"
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # failures must be consecutive
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == "closed" and breaker.admit() == "call"
    breaker.record_failure()
    assert breaker.state == "open" and breaker.admit() is None
    now[0] = 9.9
    assert breaker.admit() is None
    now[0] = 10.0
    assert breaker.state == "half_open"
    assert breaker.admit() == "trial" and breaker.admit() is None  # one trial at a time
    breaker.record_failure()  # a failed trial reopens it for another cooldown
    assert breaker.state == "open"
    now[0] = 19.9
    assert breaker.admit() is None
    now[0] = 20.0
    assert breaker.admit() == "trial"
    breaker.release("trial")  # the trial's client left before any verdict: the next call is the trial
    assert breaker.admit() == "trial"
    breaker.release("call")  # an ordinary call's release leaves the trial in flight
    assert breaker.admit() is None
    breaker.record_success()
    assert breaker.state == "closed" and breaker.admit() == "call"
    assert breaker.as_dict() == {
        "breaker": "closed",
        "breaker_open": 0,
        "breaker_consecutive_failures": 0,
        "breaker_times_opened": 2,
    }


# --- a stub remote ---------------------------------------------------------------------------------------


def _error(message: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@dataclass
class Stub:
    """An OpenAI-style `/v1/completions` server: its first `fail` calls answer `status`; then it streams
    TOKENS, a `length` finish and a usage of USAGE completion tokens (not 3: the server's count must win)."""

    fail: int = 0
    status: int = 503
    retry_after: str | None = None
    drop_after: int | None = None  # stream this many tokens, then drop the connection
    bodies: list[dict[str, Any]] = field(default_factory=list)

    TOKENS = ("Hello", ",", " world")
    USAGE = 7

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            if len(self.bodies) <= self.fail:
                headers = {"retry-after": self.retry_after} if self.retry_after else None
                return JSONResponse(_error("the stub is busy"), status_code=self.status, headers=headers)
            if body["max_tokens"] > 100:
                error = _error("max_tokens is too large for the stub", code="context_length_exceeded")
                return JSONResponse(error, status_code=400)
            return StreamingResponse(self._events(len(body["prompt"])), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])

    async def _events(self, prompt_tokens: int) -> AsyncIterator[str]:
        for i, text in enumerate(self.TOKENS):
            if i == self.drop_after:
                raise ConnectionAbortedError("the stub drops the connection")
            yield _sse({"choices": [{"index": 0, "text": text, "finish_reason": None}]})
        yield _sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": self.USAGE}
        yield _sse({"choices": [], "usage": {**usage, "total_tokens": prompt_tokens + self.USAGE}})
        yield "data: [DONE]\n\n"


def serve(app: Starlette) -> tuple[str, Callable[[], None]]:
    return run_in_thread(app, lifespan="off", log_level="critical", timeout=30)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def stub() -> Iterator[tuple[Stub, str]]:
    s = Stub()
    url, stop = serve(s.app())
    yield s, url
    stop()


def remote_engine(model_dir: Path, url: str, **config: Any) -> RemoteEngine:
    settings = RemoteConfig(url=url, model="stub-model", backoff_s=0.01, **config)
    return RemoteEngine.from_dir(model_dir, settings, name="remote", max_model_len=None)


REQUEST = EngineRequest("r-0", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0, seed=7, stop=("\n",)))


async def run(engine: RemoteEngine, *requests: EngineRequest) -> list[RequestOutput]:
    engine.start()
    try:
        stream = engine.open(list(requests))
        try:
            return [out async for out in stream]
        finally:
            await stream.aclose()
    finally:
        await engine.aclose()


@pytest.mark.parametrize(("status", "retry_after"), [(503, None), (502, None), (429, "0.05")])
def test_failures_before_the_first_token_are_retried(
    stub: tuple[Stub, str], tiny_dir: Path, status: int, retry_after: str | None
) -> None:
    s, url = stub
    s.fail, s.status, s.retry_after = 2, status, retry_after
    engine = remote_engine(tiny_dir, url, max_retries=2)
    outs = asyncio.run(run(engine, REQUEST))
    assert len(s.bodies) == 3
    # Text passes through chunk by chunk, counted per chunk; the final count is the server's.
    assert [(o.text, o.completion_tokens, o.finish_reason) for o in outs] == [
        ("Hello", 1, None),
        (",", 2, None),
        (" world", 3, None),
        ("", Stub.USAGE, FinishReason.LENGTH),
    ]
    stats = engine.stats().as_dict()
    assert (stats["remote_calls"], stats["remote_retries"], stats["breaker"]) == (3, 2, "closed")
    assert s.bodies[0] == {
        "model": "stub-model",
        "prompt": [5, 6, 7],
        "max_tokens": 5,
        "temperature": 0.0,
        "top_p": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": 7,
        "stop": ["\n"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }  # no top_k: it is only sent when set


def test_a_text_prompt_for_servers_that_take_no_token_ids(stub: tuple[Stub, str], smollm2_dir: Path) -> None:
    """`prompt_format = "text"` (llama-cpp-python's server): the prompt goes out as the text of its ids, special
    tokens spelled out, which is the rendered chat template itself; the prompt tokens counted are still ours."""
    s, url = stub
    engine = remote_engine(smollm2_dir, url, prompt_format="text")
    messages = [{"role": "user", "content": "Name the capital of France."}]
    ids = engine.tokenizer.encode_chat(messages)
    outs = asyncio.run(run(engine, EngineRequest("r-0", ids, SamplingParams(max_tokens=5))))
    assert s.bodies[0]["prompt"] == engine.tokenizer.render_chat(messages)
    assert "<|im_start|>user\nName the capital of France.<|im_end|>" in s.bodies[0]["prompt"]
    assert outs[-1].prompt_tokens == len(ids) and outs[-1].finish_reason is FinishReason.LENGTH


def test_top_k_and_concurrent_choices_merge_into_one_stream(stub: tuple[Stub, str], tiny_dir: Path) -> None:
    s, url = stub
    params = SamplingParams(max_tokens=5, temperature=0.7, top_k=3)
    requests = [EngineRequest(f"r-{i}", [5, 6, 7], params) for i in range(2)]
    outs = asyncio.run(run(remote_engine(tiny_dir, url), *requests))
    assert len(s.bodies) == 2 and all(b["top_k"] == 3 and "seed" not in b for b in s.bodies)
    for request in requests:
        texts = [o.text for o in outs if o.request_id == request.request_id]
        assert "".join(texts) == "Hello, world"
        assert [o for o in outs if o.request_id == request.request_id][-1].completion_tokens == Stub.USAGE


def test_no_retry_after_the_first_token(stub: tuple[Stub, str], tiny_dir: Path) -> None:
    s, url = stub
    s.drop_after = 1
    engine = remote_engine(tiny_dir, url, max_retries=3)
    outs = asyncio.run(run(engine, REQUEST))
    assert len(s.bodies) == 1  # the client saw "Hello": a retry would repeat it
    assert [(o.text, o.completion_tokens, o.finish_reason) for o in outs] == [
        ("Hello", 1, None),
        ("", 1, FinishReason.ERROR),
    ]
    assert "remote failed" in (outs[-1].error or "")


def test_failures_past_the_retries_open_the_breaker(stub: tuple[Stub, str], tiny_dir: Path) -> None:
    s, url = stub
    s.fail = 100
    engine = remote_engine(tiny_dir, url, max_retries=1, breaker_failures=2, breaker_cooldown_s=60.0)

    async def twice() -> None:
        for _ in range(2):
            with pytest.raises(EngineUnavailable):
                await run(engine, REQUEST)

    asyncio.run(twice())
    assert len(s.bodies) == 2  # the second request found the circuit open and made no call
    stats = engine.stats().as_dict()
    assert (stats["breaker"], stats["breaker_open"], stats["remote_failures"]) == ("open", 1, 2)
    engine.start()
    assert not engine.alive  # started, but open: the gateway goes to the fallback


def test_a_remote_4xx_is_the_requests_fault(stub: tuple[Stub, str], tiny_dir: Path) -> None:
    s, url = stub
    engine = remote_engine(tiny_dir, url, breaker_failures=1)
    too_long = EngineRequest("r-0", [5, 6, 7], SamplingParams(max_tokens=500))
    with pytest.raises(RequestRejected, match="max_tokens is too large") as info:
        asyncio.run(run(engine, too_long))
    assert info.value.code == "context_length_exceeded"
    assert len(s.bodies) == 1 and engine.stats().as_dict()["breaker"] == "closed"  # not retried, not a failure


# --- settings and loading ------------------------------------------------------------------------------------


def test_settings_check_fallbacks_and_what_remote_tiers_can_do(monkeypatch: pytest.MonkeyPatch) -> None:
    ok = Settings(tiers={"remote": {"url": "http://127.0.0.1:9", "fallback": "small"}, "small": {}})
    assert ok.tiers["remote"].is_remote and not ok.tiers["small"].is_remote
    bad = [
        ({"a": {"fallback": "nope"}}, "fallback 'nope' is not a tier"),
        ({"a": {"fallback": "b"}, "b": {"fallback": "a"}}, "cycle: a -> b -> a"),
        ({"a": {"fallback": "a"}}, "cycle"),
        ({"a": {"url": "http://x", "speculative": "ngram"}}, "cannot speculate"),
        ({"a": {"url": "http://x", "kv_tier": True}}, "cannot speculate or use the KV tier"),
        ({"a": {"url": "http://x"}, "b": {"speculative": "draft", "draft_tier": "a"}}, "a draft must run here"),
    ]
    for tiers, message in bad:
        with pytest.raises(ValueError, match=message):
            Settings(tiers=tiers)

    tier = TierSettings(url="http://x", api_key_env="SB_TEST_REMOTE_KEY_X")
    monkeypatch.delenv("SB_TEST_REMOTE_KEY_X", raising=False)
    with pytest.raises(ValueError, match="SB_TEST_REMOTE_KEY_X, which is not set"):
        tier.remote_api_key()
    monkeypatch.setenv("SB_TEST_REMOTE_KEY_X", "sk-from-env")
    assert tier.remote_api_key() == "sk-from-env"
    inline = TierSettings(url="http://x", api_key="sk-inline")
    assert inline.remote_api_key() == "sk-inline" and "sk-inline" not in repr(inline)


def test_a_fallback_must_share_the_vocabulary(tiny_dir: Path, smollm2_dir: Path, tmp_path: Path) -> None:
    def tiers(fallback_dir: Path) -> Settings:
        remote = {"model": str(smollm2_dir), "url": "http://127.0.0.1:9", "fallback": "other"}
        return Settings(home=tmp_path, tiers={"remote": remote, "other": {"model": str(fallback_dir), "url": "x"}})

    same = tiers(smollm2_dir)
    check_fallbacks(same, {name: load_remote(same, name, t) for name, t in same.tiers.items()})
    other = tiers(tiny_dir)
    with pytest.raises(ValueError, match="'remote': fallback 'other' tokenizes with another vocabulary"):
        check_fallbacks(other, {name: load_remote(other, name, t) for name, t in other.tiers.items()})


# --- a remote switchboard behind a live gateway ------------------------------------------------------------

REMOTE_CONTEXT = 512  # the remote serves a shorter context than the gateway assumes: its 400 must reach us
KEY_ENV = "SB_TEST_REMOTE_TIER_KEY"
NO_STORE = {"x-switchboard-cache-control": "no-store"}  # every request reaches a tier
MAX_TOKENS = 12
QUESTIONS = [
    "Name the capital of France.",
    "What colour is the sky on a clear day?",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
    "Name a planet in our solar system.",
]
PRICES = {
    "small": {"prompt": "0.10", "cached_prompt": "0.01", "completion": "0.40"},
    "large": {"prompt": "0.50", "cached_prompt": "0.05", "completion": "2.00"},
    "remote": {"prompt": "1.00", "cached_prompt": "0.10", "completion": "3.00"},
}


class RemoteSwitchboard(services.ServerProcess):
    """`switchboard serve` in a process of its own: SmolLM2 as tier `small`, its own SQLite database,
    the shared models cache (nothing is fetched again), and a tenant key made with the CLI."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir / "remote.log", "the remote switchboard")
        self.url = f"http://127.0.0.1:{services.free_port()}"
        self.database_url = f"sqlite:///{workdir / 'remote.db'}"
        self.env = {
            **os.environ,
            "SWITCHBOARD_HOME": str(MODELS_HOME),
            "SWITCHBOARD_DATABASE_URL": self.database_url,
            "SWITCHBOARD_PROFILE": "tiny",
            "SWITCHBOARD_TIERS__SMALL__MAX_MODEL_LEN": str(REMOTE_CONTEXT),
            "SWITCHBOARD_KV_POOL_BYTES": "64MiB",
            "SWITCHBOARD_PORT": self.url.rsplit(":", 1)[1],
            "SWITCHBOARD_LOG_FORMAT": "text",
            "SWITCHBOARD_LOG_LEVEL": "warning",
        }
        created = subprocess.run(
            [SWITCHBOARD, "tenant", "create", "gateway"], env=self.env, capture_output=True, text=True, timeout=120
        )
        assert created.returncode == 0, created.stderr
        self.key = created.stdout.strip()

    def start(self) -> None:
        self.launch([SWITCHBOARD, "serve"], f"{self.url}/healthz", timeout=180, env=self.env, every=0.2)

    def usage(self, count: int) -> list[tuple[int, int]]:
        """(prompt, completion) tokens of the remote's own ledger rows, once it holds `count` of them."""
        engine = sa.create_engine(self.database_url)
        try:
            deadline = time.monotonic() + 15
            while True:
                with engine.connect() as conn:
                    q = sa.select(Usage.prompt_tokens, Usage.completion_tokens).order_by(Usage.created_at)
                    rows = [(p, c) for p, c in conn.execute(q)]
                if len(rows) >= count or time.monotonic() > deadline:
                    return rows
                time.sleep(0.05)
        finally:
            engine.dispose()


@dataclass
class Reply:
    id: str
    text: str
    usage: tuple[int, int]  # prompt, completion
    tier: str  # x-switchboard-tier
    model: str
    content_chunks: int = 1


def chat(client: openai.OpenAI, question: str, model: str, *, stream: bool, max_tokens: int = MAX_TOKENS) -> Reply:
    messages: Any = [{"role": "user", "content": question}]
    common: Any = dict(model=model, messages=messages, temperature=0, max_tokens=max_tokens, extra_headers=NO_STORE)
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**common)
        reply = raw.parse()
        assert reply.usage is not None
        usage = (reply.usage.prompt_tokens, reply.usage.completion_tokens)
        content = reply.choices[0].message.content or ""
        return Reply(reply.id, content, usage, raw.headers["x-switchboard-tier"], reply.model)
    with client.chat.completions.with_streaming_response.create(
        **common, stream=True, stream_options={"include_usage": True}
    ) as response:
        tier = response.headers["x-switchboard-tier"]
        chunks = list(response.parse())
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    usage_chunk = chunks[-1].usage
    assert usage_chunk is not None
    usage = (usage_chunk.prompt_tokens, usage_chunk.completion_tokens)
    return Reply(chunks[0].id, "".join(pieces), usage, tier, chunks[0].model, len(pieces))


@dataclass
class Gateway:
    live: LiveServer
    remote: RemoteSwitchboard
    engine: RemoteEngine
    policy: Policy
    checkpoint: str  # both tiers' `model`, as the ledger records it

    def tenant(self) -> tuple[openai.OpenAI, int, str]:
        """A tenant with prices for `remote` (dearer than `small`): its client, id and an admin key."""
        key = self.live.new_key()
        who = authenticate(self.live.db, key)
        assert who is not None
        app_services(self.live.app).policies.save(who.tenant_id, self.policy, "test")
        admin = create_key(self.live.db, who.tenant_name, "admin").key
        client = openai.OpenAI(base_url=f"{self.live.base_url}/v1", api_key=key, max_retries=0, timeout=120)
        return client, who.tenant_id, admin

    def row(self, reply: Reply) -> Usage:
        (row,) = self.live.wait_for_usage(reply.id)
        return row

    def cost(self, tier: str, row: Usage) -> Decimal:
        tokens = Tokens(row.prompt_tokens, row.completion_tokens, cached_prompt=row.cached_prompt_tokens)
        return charge(self.policy, tier, tokens).cost

    def stats(self, admin: str) -> dict[str, Any]:
        r = httpx.get(f"{self.live.base_url}/v1/engine/stats", headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 200
        return r.json()["remote"]


@pytest.fixture(scope="module")
def gateway(
    small_engine: AsyncEngine,
    smollm2_dir: Path,
    postgres_server: str,
    redis_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Gateway]:
    remote = RemoteSwitchboard(tmp_path_factory.mktemp("remote"))
    remote.start()
    url, drop = services.create_database(postgres_server)
    namespace = f"sbtest-{uuid.uuid4().hex[:10]}"
    tiers = {
        "remote": {
            "model": str(smollm2_dir),  # its tokenizer; the remote serves the same model as tier `small`
            "url": remote.url,
            "remote_model": "small",
            "embedding_model": "minilm",  # the remote switchboard's own embedder
            "api_key_env": KEY_ENV,
            "fallback": "small",
            "max_retries": 1,
            "breaker_failures": 2,
            "breaker_cooldown_s": 3.0,
        },
        "small": {"model": str(smollm2_dir)},
    }
    settings = Settings(
        home=tmp_path_factory.mktemp("home"),
        database_url=url,
        redis_url=redis_server,
        redis_namespace=namespace,
        tiers=tiers,
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv(KEY_ENV, remote.key)
        engine = load_remote(settings, "remote", settings.tiers["remote"])
    engines = {"remote": engine, "small": small_engine}
    check_fallbacks(settings, engines)
    from gateway.app import create_app

    db = Database(url)
    live, stop = start_server(create_app(settings, engines=engines, database=db), db)
    try:
        yield Gateway(live, remote, engine, Policy.model_validate({"prices": PRICES}), str(smollm2_dir))
    finally:
        stop()
        engine.shutdown()
        db.dispose()
        drop()
        remote.stop()
        services.delete_namespace(redis_server, namespace)


def test_a_remote_400_is_our_400_and_nothing_is_billed(gateway: Gateway) -> None:
    client, tenant_id, admin = gateway.tenant()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, QUESTIONS[0], "remote", stream=stream, max_tokens=REMOTE_CONTEXT)
        error = info.value.body
        assert isinstance(error, dict) and error["code"] == "context_length_exceeded"
        assert error["message"].startswith("The model server refused the request: ")
        assert f"maximum context length is {REMOTE_CONTEXT} tokens" in error["message"]
    assert gateway.live.usage_rows(tenant_id=tenant_id) == []  # nothing ran, here or (so) on the fallback
    stats = gateway.stats(admin)
    assert stats["breaker"] == "closed" and stats["alive"] is True  # the request's fault, not the remote's


def test_remote_tier_serves_falls_back_while_down_and_recovers(gateway: Gateway) -> None:
    client, tenant_id, admin = gateway.tenant()
    seen = len(gateway.remote.usage(0))

    # 1. The remote serves: the local engine's greedy answer (same model), the remote's usage, one row
    #    for tier `remote` at its prices. Streamed text arrives in pieces, as the remote generates it.
    for question, stream in zip(QUESTIONS[:2], (False, True), strict=True):
        local = chat(client, question, "small", stream=False)
        got = chat(client, question, "remote", stream=stream)
        assert (got.tier, got.model, local.tier) == ("remote", "remote", "small")
        assert got.text == local.text and got.text
        assert got.usage == local.usage
        seen += 1
        assert gateway.remote.usage(seen)[-1] == got.usage  # what the remote itself recorded
        row = gateway.row(got)
        assert (row.tier, row.model, row.status) == ("remote", gateway.checkpoint, "ok")
        assert (row.prompt_tokens, row.completion_tokens) == got.usage
        assert row.cost == gateway.cost("remote", row) != gateway.cost("small", row)
        if stream:
            assert got.content_chunks > 1

    # 2. The remote dies: requests fall back to `small` with no 5xx, billed at its prices; the first
    #    one's failures (a call and its retry) open the breaker, and stats and health say so.
    gateway.remote.kill()
    first = chat(client, QUESTIONS[2], "remote", stream=True)
    stats = gateway.stats(admin)
    health = httpx.get(f"{gateway.live.base_url}/healthz")
    assert (stats["breaker"], stats["alive"], stats["breaker_times_opened"]) == ("open", False, 1)
    assert health.json()["engines"]["remote"] == {"running": 0, "alive": False, "breaker": "open"}
    assert health.status_code == 200  # `small` serves the remote tier's requests meanwhile
    fallbacks = [first, chat(client, QUESTIONS[3], "remote", stream=False)]
    for got in fallbacks:
        assert (got.tier, got.model) == ("small", "remote") and got.text
        row = gateway.row(got)
        assert (row.tier, row.model, row.status) == ("small", gateway.checkpoint, "ok")
        assert row.cost == gateway.cost("small", row) != gateway.cost("remote", row)
    assert len(gateway.remote.usage(0)) == seen

    # 3. Back on the same port: after the cooldown the next request is the breaker's trial, served by
    #    the remote, and the circuit closes.
    gateway.remote.start()
    time.sleep(gateway.engine.config.breaker_cooldown_s)
    back = chat(client, QUESTIONS[4], "remote", stream=False)
    assert back.tier == "remote" and gateway.row(back).tier == "remote"
    assert gateway.remote.usage(seen + 1)[-1] == back.usage
    stats = gateway.stats(admin)
    assert (stats["breaker"], stats["alive"]) == ("closed", True)
    assert httpx.get(f"{gateway.live.base_url}/healthz").json()["engines"]["remote"]["breaker"] == "closed"
    rows = gateway.live.usage_rows(tenant_id=tenant_id)
    assert len(rows) == 2 * 2 + 2 + 1  # one per request: local and remote pairs, two fallbacks, one recovered


def test_embeddings_on_a_remote_tier_are_its_servers_own(gateway: Gateway) -> None:
    """`model: "remote"` on /v1/embeddings goes to the remote's /v1/embeddings (its `embedding_model`): the
    vectors and token count are what that server answers directly; one row here, priced at `remote`."""
    client, tenant_id, _ = gateway.tenant()
    texts = ["The cat sat on the mat.", "Paris is the capital of France."]
    got = client.embeddings.create(model="remote", input=texts)
    direct = openai.OpenAI(base_url=f"{gateway.remote.url}/v1", api_key=gateway.remote.key, max_retries=0)
    want = direct.embeddings.create(model="minilm", input=texts)
    assert [d.embedding for d in got.data] == [d.embedding for d in want.data]
    assert got.usage.prompt_tokens == want.usage.prompt_tokens > 0
    (row,) = gateway.live.usage_rows(tenant_id=tenant_id)
    assert (row.endpoint, row.tier, row.model, row.completion_tokens) == ("embeddings", "remote", "minilm", 0)
    assert row.cost == Decimal(want.usage.prompt_tokens) * Decimal("1.00") / Decimal(1_000_000)
