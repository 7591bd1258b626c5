"""Tenant isolation through a live gateway on PostgreSQL and Redis, for the stores tenants share: the
engine's prefix cache and the exact and semantic response caches. Each check also runs against a
deliberately broken gateway (the prefix-cache salt dropped, the cache's tenant id swapped) and must
see the leak there: a check that passed on both would prove nothing."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

import services
from engines.async_engine import AsyncEngine
from engines.engine import Engine
from engines.kv.tier import KVTier, checkpoint_fingerprint
from gateway.accounting.tenants import authenticate
from gateway.api.deps import app_config, app_services, running_pipeline
from live import LiveServer, serve_gateway
from policies.policy import Policy

BLOCK = 16  # the engine's KV block: the prefix cache matches whole blocks
# A paraphrase pair the calibrated semantic cache must treat as one request (tests/gateway/test_semantic_cache.py).
STORED, PARAPHRASE = "How do I reverse a list in Python?", "What's the way to reverse a Python list?"


@pytest.fixture(scope="module")
def gateway(
    small_engine: AsyncEngine, postgres_server: str, redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    url, drop = services.create_database(postgres_server)
    live, stop = serve_gateway(small_engine, tmp_path_factory.mktemp("home"), url, redis_url=redis_server)
    yield live
    stop()
    drop()


@dataclass
class Tenant:
    client: httpx.Client
    tenant_id: int

    def chat(self, messages: list[dict], **body: Any) -> httpx.Response:
        payload = {"model": "small", "messages": messages, "temperature": 0, "max_tokens": 4, **body}
        r = self.client.post("/v1/chat/completions", json=payload)
        assert r.status_code == 200, r.text
        return r


def tenant(live: LiveServer, **cache: Any) -> Tenant:
    key = live.new_key()
    who = authenticate(live.db, key)
    if cache:
        app_services(live.app).policies.save(who.tenant_id, Policy.model_validate({"cache": cache}), "test")
    client = httpx.Client(base_url=live.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    return Tenant(client, who.tenant_id)


@contextmanager
def patched(obj: object, name: str, value: Callable) -> Iterator[None]:
    """`obj.name = value` for the block: the deliberately broken gateway."""
    setattr(obj, name, value)
    try:
        yield
    finally:
        delattr(obj, name)  # instance attributes only: the class's method shows through again


# --- the engine's prefix cache ----------------------------------------------------------------------------


def system_prompt() -> list[dict]:
    """A system prompt of about 1,000 tokens no earlier request began with, and a question."""
    tag = uuid.uuid4().hex
    rules = " ".join(f"Rule {i}: ledger {tag[i % 32]}{i * 7} must balance before order {i} ships." for i in range(64))
    return [{"role": "system", "content": f"Policy {tag}. {rules}"}, {"role": "user", "content": "Summarize."}]


def prefix_cached(live: LiveServer, one: Tenant, two: Tenant) -> tuple[int, int, int, int]:
    """Prompt tokens, and the cached prompt tokens of: the first tenant's request, the second tenant's same
    request, the first tenant's repeat (from their ledger rows)."""
    messages = system_prompt()
    cached = []
    for who in (one, two, one):
        rid = who.chat(messages, cache="no-store").json()["id"]
        (row,) = live.wait_for_usage(rid)
        assert row.tenant_id == who.tenant_id and row.status == "ok"
        cached.append(row.cached_prompt_tokens)
    return row.prompt_tokens, *cached


def test_a_tenant_never_reuses_another_tenants_prompt_prefix(gateway: LiveServer, small_engine: AsyncEngine) -> None:
    assert small_engine.engine.config.block_size == BLOCK
    prompt, first, other, repeat = prefix_cached(gateway, tenant(gateway), tenant(gateway))
    assert prompt > 1000
    assert first == 0  # a prompt nobody sent before
    assert other == 0  # the same 1,000 tokens from another tenant: no hit, so no faster first token
    assert repeat >= prompt - BLOCK  # the tenant's own repeat: every full block of it


def test_the_prefix_check_sees_a_dropped_salt(gateway: LiveServer) -> None:
    pipeline = running_pipeline(gateway.app)
    with patched(pipeline, "salt", lambda principal: ""):  # the salt dropped: one cache for every tenant
        prompt, first, other, _ = prefix_cached(gateway, tenant(gateway), tenant(gateway))
    assert first == 0 and other >= prompt - BLOCK  # the leak the isolation test would fail on


# --- the exact and semantic response caches ----------------------------------------------------------------


def ask(who: Tenant, text: str) -> tuple[str, str]:
    r = who.chat([{"role": "user", "content": text}], max_tokens=8)
    return r.headers["x-switchboard-cache"], r.json()["id"]


def response_cache_statuses(live: LiveServer) -> dict[str, str]:
    """Cache statuses: a tenant storing an answer, then reading it exactly and by a paraphrase; a second
    tenant asking the exact text, a third the paraphrase. All three cache semantically."""
    one, two, three = (tenant(live, semantic=True) for _ in range(3))
    text = f"{STORED} ({uuid.uuid4().hex[:6]})"  # tagged: no earlier run of the test stored it
    paraphrase = f"{PARAPHRASE} ({text[-7:-1]})"
    out = {}
    out["stored"], stored_id = ask(one, text)
    out["own exact"], _ = ask(one, text)
    out["own paraphrase"], para_id = ask(one, paraphrase)
    out["other exact"], _ = ask(two, text)
    out["other paraphrase"], _ = ask(three, paraphrase)
    (stored,) = live.wait_for_usage(stored_id)
    (para,) = live.wait_for_usage(para_id)
    if out["own paraphrase"] == "semantic-hit":  # billed to its tenant as a hit: nothing, all of it saved
        assert para.tenant_id == one.tenant_id and para.cache_status == "semantic-hit"
        assert para.cost == 0 and para.saved_cache == para.counterfactual_cost > 0
        assert para.completion_tokens == stored.completion_tokens
    return out


def semantic_tenants(live: LiveServer) -> set[int]:
    """Tenant ids with semantic-cache entries under this gateway's Redis namespace."""
    ns = app_config(live.app).settings.redis_namespace
    client = redis.Redis.from_url(services.redis_url())
    try:
        return {int(k.decode().rsplit(":", 1)[1]) for k in client.scan_iter(f"{ns}:sem:*")}
    finally:
        client.close()


def test_response_caches_keep_tenants_apart_and_bill_a_semantic_hit_as_a_hit(gateway: LiveServer) -> None:
    before = semantic_tenants(gateway)
    statuses = response_cache_statuses(gateway)
    assert statuses == {
        "stored": "miss",
        "own exact": "hit",
        "own paraphrase": "semantic-hit",
        "other exact": "miss",
        "other paraphrase": "miss",
    }
    # every tenant's entries under its own id: the three new tenants each stored one answer
    assert len(semantic_tenants(gateway) - before) == 3


def test_the_cache_check_sees_a_swapped_tenant_id(gateway: LiveServer) -> None:
    stage = running_pipeline(gateway.app).cache
    exact_get, semantic_lookup = stage.exact.get, stage.semantic.lookup
    first: list[int] = []

    def one_tenant(tenant_id: int) -> int:  # every request read under the first caller's tenant id
        first.append(tenant_id)
        return first[0]

    async def get(tenant_id: int, key: str) -> Any:
        return await exact_get(one_tenant(tenant_id), key)

    async def lookup(tenant_id: int, *args: Any) -> Any:
        return await semantic_lookup(one_tenant(tenant_id), *args)

    with patched(stage.exact, "get", get), patched(stage.semantic, "lookup", lookup):
        statuses = response_cache_statuses(gateway)
    assert statuses["other exact"] == "hit"  # the leak the isolation test would fail on
    assert statuses["other paraphrase"] in ("hit", "semantic-hit")


# --- the Redis KV tier, read by a fresh engine ---------------------------------------------------------------


def kv_tier_cached(
    smollm2_dir: Path, home: Path, database_url: str, namespace: str, *, drop_salt: bool
) -> tuple[int, int, int]:
    """Prompt tokens, and the cached prompt tokens of: the second tenant's, then the first tenant's request of
    a prompt the first tenant sent through another gateway, whose engine (now gone) wrote it to the KV tier.
    The second gateway's engine starts with an empty local cache: only the tier can supply a prefix."""
    keys: dict[str, str] = {}
    cached: list[int] = []
    messages = system_prompt()
    for turn, senders in enumerate((("one",), ("two", "one"))):
        tier = KVTier(services.redis_url(), namespace, checkpoint=checkpoint_fingerprint(smollm2_dir), min_blocks=1)
        engine = AsyncEngine(Engine.from_dir(smollm2_dir, dtype="bf16", kv_tier=tier), name="small")
        engine.start()
        live, stop = serve_gateway(engine, home, database_url)
        try:
            if drop_salt:  # the deliberately broken gateway: one prefix namespace for every tenant
                running_pipeline(live.app).salt = lambda principal: ""  # type: ignore[method-assign]
            for name in senders:
                keys.setdefault(name, live.new_key())
                auth = {"Authorization": f"Bearer {keys[name]}"}  # 120 s: a fresh engine prefills ~1,270 tokens
                who = Tenant(httpx.Client(base_url=live.base_url, headers=auth, timeout=120), 0)
                rid = who.chat(messages, cache="no-store").json()["id"]
                (row,) = live.wait_for_usage(rid)
                if turn:
                    cached.append(row.cached_prompt_tokens)
            tier.flush()
            assert tier.stats.errors == 0
        finally:
            stop()
            engine.shutdown()
            tier.close()
    return row.prompt_tokens, cached[0], cached[1]


@pytest.mark.parametrize("drop_salt", [False, True], ids=["gateway", "broken-salt"])
def test_the_kv_tier_keeps_tenants_apart_across_engines(
    smollm2_dir: Path, postgres_server: str, redis_namespace: str, tmp_path: Path, drop_salt: bool
) -> None:
    url, drop = services.create_database(postgres_server)
    try:
        prompt, other, own = kv_tier_cached(smollm2_dir, tmp_path, url, redis_namespace, drop_salt=drop_salt)
    finally:
        drop()
    assert own >= prompt - BLOCK  # the tenant's own prefix, restored from Redis by a fresh engine
    if drop_salt:
        assert other >= prompt - BLOCK  # the leak the real gateway's check fails on
    else:
        assert other == 0
