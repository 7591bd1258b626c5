"""The response cache through a live gateway on real Redis: hits and their header, billing and
savings; tenant isolation; streamed replay; client bypass; TTL; and Redis stopped mid-test and
restarted with no failed request."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

import services
from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import authenticate
from gateway.api.deps import app_services
from live import LiveServer, serve_gateway
from policies.policy import Policy

QUESTION = [{"role": "user", "content": "Name the capital of France."}]


def gateway(small_engine: AsyncEngine, home: Path, redis_url: str) -> tuple[LiveServer, Callable[[], None]]:
    return serve_gateway(small_engine, home, f"sqlite:///{home / 'switchboard.db'}", redis_url=redis_url)


@pytest.fixture(scope="module")
def server(
    small_engine: AsyncEngine, redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    live, stop = gateway(small_engine, tmp_path_factory.mktemp("home"), redis_server)
    yield live
    stop()


def tenant(live: LiveServer, **cache: object) -> tuple[httpx.Client, int]:
    key = live.new_key()
    who = authenticate(live.db, key)
    if cache:
        app_services(live.app).policies.save(who.tenant_id, Policy.model_validate({"cache": cache}), "test")
    client = httpx.Client(base_url=live.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    return client, who.tenant_id


def chat(client: httpx.Client, **body: object) -> httpx.Response:
    r = client.post("/v1/chat/completions", json={"model": "small", "messages": QUESTION, "temperature": 0,
                                                   "max_tokens": 12, **body})  # fmt: skip
    assert r.status_code == 200, r.text
    return r


def streamed(client: httpx.Client, **body: object) -> tuple[str, str]:
    import json

    text, payload = "", {"model": "small", "messages": QUESTION, "temperature": 0, "max_tokens": 12, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json={**payload, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
        return text, r.headers["x-switchboard-cache"]


def test_a_repeat_is_a_hit_billed_as_one(server: LiveServer) -> None:
    client, _ = tenant(server)
    first = chat(client)
    assert first.headers["x-switchboard-cache"] == "miss"
    # the same request, differently spelled: whitespace, key order, 0 vs 0.0
    messages = [{"content": "  Name the capital   of France. ", "role": "user"}]
    again = chat(client, messages=messages, temperature=0.0)
    assert again.headers["x-switchboard-cache"] == "hit"
    a, b = first.json(), again.json()
    assert b["choices"] == a["choices"] and b["id"] != a["id"]
    assert b["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]
    (row,) = server.wait_for_usage(b["id"])
    assert row.cache_status == "hit" and row.cost == 0 and row.saved_cache == row.counterfactual_cost > 0
    (orig,) = server.wait_for_usage(a["id"])
    assert orig.cache_status == "miss" and orig.cost > 0
    # different parameters are a different request
    assert chat(client, max_tokens=11).headers["x-switchboard-cache"] == "miss"


def test_tenants_never_share_entries(server: LiveServer) -> None:
    one, _ = tenant(server)
    two, _ = tenant(server)
    chat(one, seed=7)
    assert chat(one, seed=7).headers["x-switchboard-cache"] == "hit"
    assert chat(two, seed=7).headers["x-switchboard-cache"] == "miss"


def test_streamed_replay_equals_the_original_stream(server: LiveServer) -> None:
    client, _ = tenant(server)
    original, status = streamed(client, max_tokens=20)
    assert status == "miss" and original
    replay, status = streamed(client, max_tokens=20)
    assert (replay, status) == (original, "hit")
    plain = chat(client, max_tokens=20)
    assert (
        plain.headers["x-switchboard-cache"] == "hit" and plain.json()["choices"][0]["message"]["content"] == original
    )


def test_bypass_nondeterministic_and_ttl(server: LiveServer) -> None:
    client, _ = tenant(server, ttl_seconds=1)
    chat(client, seed=1)
    assert chat(client, seed=1, cache="no-cache").headers["x-switchboard-cache"] == "miss"  # not read
    assert chat(client, seed=1).headers["x-switchboard-cache"] == "hit"
    r = client.post("/v1/chat/completions", headers={"x-switchboard-cache-control": "no-store"},
                    json={"model": "small", "messages": QUESTION, "seed": 1, "max_tokens": 12})  # fmt: skip
    assert r.headers["x-switchboard-cache"] == "miss"
    assert chat(client, temperature=1.0).headers["x-switchboard-cache"] == "miss"  # sampling, no seed
    assert chat(client, temperature=1.0).headers["x-switchboard-cache"] == "miss"
    bad = client.post("/v1/chat/completions", json={"model": "small", "messages": QUESTION, "cache": "sometimes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache"
    time.sleep(1.5)
    assert chat(client, seed=1).headers["x-switchboard-cache"] == "miss"  # expired
    off, _ = tenant(server, enabled=False)
    chat(off)
    assert chat(off).headers["x-switchboard-cache"] == "miss"


def test_redis_down_mid_test_serves_every_request_and_recovers(small_engine: AsyncEngine, tmp_path: Path) -> None:
    redis = services.RedisServer()  # of its own, to kill and restart (no `redis-server`: fails, saying so)
    redis.start()
    live, stop = gateway(small_engine, tmp_path, redis.url)
    try:
        client, tid = tenant(live)
        assert chat(client).headers["x-switchboard-cache"] == "miss"
        assert chat(client).headers["x-switchboard-cache"] == "hit"
        redis.kill()
        for _ in range(4):  # Redis is gone: every request still answers, from the engine
            r = chat(client)
            assert r.headers["x-switchboard-cache"] == "miss"
        redis.start()  # back on the same port, empty
        deadline = time.monotonic() + 30
        while chat(client).headers["x-switchboard-cache"] != "hit":  # stored again once reachable
            assert time.monotonic() < deadline, "the cache did not come back"
            time.sleep(0.5)
        rows = live.usage_rows(tenant_id=tid)
        assert all(r.status == "ok" for r in rows) and len(rows) >= 7
        spent = sum((r.cost for r in rows), Decimal(0))
        assert spent > 0
    finally:
        stop()
        redis.kill()
