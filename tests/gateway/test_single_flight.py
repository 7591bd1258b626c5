"""Single flight through a live gateway on PostgreSQL and Redis: identical deterministic requests that arrive
while the first one generates wait for it and are served its answer as hits (one generation, one ledger row
each, billed as hits, counted in /metrics); a streamed twin gets the same text as it comes; a leader that
fails or whose client leaves releases its followers, which then run on their own; other tenants, other
answer-changing parameters, `no-cache` and another question never wait; a paraphrase waits with
`cache.semantic` on.

The leader is held mid-generation by a gate on the engine (`HeldEngine`): who arrives while it generates is
decided by the test, never by timing, and nothing here asserts a duration.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from held_engine import HeldEngine
from prometheus_client.parser import text_string_to_metric_families

import services
from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import authenticate
from gateway.api.deps import app_services
from gateway.cache.normalize import request_key
from gateway.cache.stage import CacheDecision
from gateway.pipeline.single_flight import Flight, Flights, join
from live import LiveServer, serve_gateway
from policies.policy import CacheSettings, Policy

POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
BODY = {"model": "small", "messages": POEM, "temperature": 0, "max_tokens": 32}
WAIT = 120.0  # seconds: a safety net against a hang, never a measured expectation


@pytest.fixture(scope="module")
def held(small_engine: AsyncEngine) -> HeldEngine:
    return HeldEngine(small_engine)


@pytest.fixture(scope="module")
def server(
    held: HeldEngine, postgres_server: str, redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    url, drop = services.create_database(postgres_server)
    live, stop = serve_gateway(held, tmp_path_factory.mktemp("home"), url, redis_url=redis_server)  # type: ignore[arg-type]
    yield live
    stop()
    drop()


# --- clients ----------------------------------------------------------------------------------------------------


def tenant(live: LiveServer, **cache: object) -> tuple[httpx.Client, int]:
    key = live.new_key()
    who = authenticate(live.db, key)
    assert who is not None
    if cache:
        app_services(live.app).policies.save(who.tenant_id, Policy.model_validate({"cache": cache}), "test")
    client = httpx.Client(base_url=live.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=WAIT)
    return client, who.tenant_id


def chat(client: httpx.Client, **body: object) -> httpx.Response:
    return client.post("/v1/chat/completions", json={**BODY, **body})


@dataclass
class Streamed:
    id: str
    text: str
    headers: httpx.Headers
    usage: dict | None


def streamed(client: httpx.Client, **body: object) -> Streamed:
    payload = {**BODY, "stream": True, "stream_options": {"include_usage": True}, **body}
    out = Streamed("", "", httpx.Headers(), None)
    with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        out.headers = r.headers
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                out.id = chunk["id"]
                out.usage = chunk.get("usage") or out.usage
                out.text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    return out


def content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


def flight_of(live: LiveServer, tenant_id: int, *, deltas: int = 0) -> Flight:
    """The tenant's one leader, once it generates (and has produced `deltas` deltas)."""
    flights = app_services(live.app).pipeline.flights

    def ready() -> bool:
        air = flights.in_air(tenant_id)
        return len(air) == 1 and air[0].state == "started" and len(air[0].deltas) >= deltas

    until(ready, "the leader to generate")
    return flights.in_air(tenant_id)[0]


def one_row(live: LiveServer, request_id: str) -> Any:
    rows = live.wait_for_usage(request_id)
    assert len(rows) == 1, (request_id, rows)
    return rows[0]


def scrape(live: LiveServer) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{live.base_url}/metrics", timeout=30).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def flight_hits(live: LiveServer, kind: str) -> float:
    return scrape(live).get(("switchboard_single_flight_hits_total", frozenset({("tier", "small"), ("kind", kind)})), 0)


def released(live: LiveServer) -> float:
    return scrape(live)[("switchboard_single_flight_released_total", frozenset())]


# --- the tests ----------------------------------------------------------------------------------------------------


def test_identical_requests_in_the_air_generate_once(server: LiveServer, held: HeldEngine) -> None:
    client, tid = tenant(server)
    generations, hits = held.opened, flight_hits(server, "exact")
    gate = held.hold_next()
    with ThreadPoolExecutor(8) as pool:
        try:
            leader = pool.submit(chat, client)
            flight = flight_of(server, tid)
            # the same request, spelled differently (key order, 0.0, whitespace), and a streamed twin
            same = {
                "messages": [{"content": " Write a short poem  about the sea. ", "role": "user"}],
                "temperature": 0.0,
            }
            followers = [pool.submit(chat, client, **(same if i % 2 else {})) for i in range(4)]
            twin = pool.submit(streamed, client)
            until(lambda: flight.joined == 5, "five followers")
            assert not leader.done() and not any(f.done() for f in [*followers, twin])  # they wait: none generates
        finally:
            gate.opened.set()
        first, rest, stream = leader.result(WAIT), [f.result(WAIT) for f in followers], twin.result(WAIT)
    assert held.opened == generations + 1  # one generation for six requests
    text, lead = content(first), first.json()
    assert text and first.headers["x-switchboard-cache"] == "miss"
    for r in rest:
        assert content(r) == text and r.json()["choices"] == lead["choices"] and r.json()["id"] != lead["id"]
        assert r.headers["x-switchboard-cache"] == "hit" and r.headers["x-switchboard-cache-source"] == lead["id"]
        assert r.json()["usage"]["completion_tokens"] == lead["usage"]["completion_tokens"]
    assert stream.text == text and stream.headers["x-switchboard-cache"] == "hit"
    assert stream.usage is not None and stream.usage["completion_tokens"] == lead["usage"]["completion_tokens"]
    row = one_row(server, lead["id"])
    assert row.cache_status == "miss" and row.status == "ok" and row.cost > 0
    for rid in [r.json()["id"] for r in rest] + [stream.id]:
        row = one_row(server, rid)  # billed once each, exactly as a cache hit
        assert (row.cache_status, row.status, row.cost) == ("flight-hit", "ok", 0)
        assert row.saved_cache == row.counterfactual_cost > 0
    assert flight_hits(server, "exact") == hits + 5
    assert app_services(server.app).pipeline.flights.in_air(tid) == []
    again = chat(client)  # the leader's answer is in the cache now
    assert again.headers["x-switchboard-cache"] == "hit" and content(again) == text
    assert held.opened == generations + 1


def test_a_leader_that_fails_releases_its_followers(server: LiveServer, held: HeldEngine) -> None:
    client, tid = tenant(server)
    generations, before = held.opened, released(server)
    gate = held.hold_next(after=4, fail=True)
    with ThreadPoolExecutor(4) as pool:
        try:
            leader = pool.submit(chat, client, max_tokens=40)
            flight_of(server, tid, deltas=1)  # the streamed follower forwards some of the leader's text first
            followers = [pool.submit(chat, client, max_tokens=40) for _ in range(2)]
            twin = pool.submit(streamed, client, max_tokens=40)
            until(lambda: app_services(server.app).pipeline.flights.in_air(tid)[0].joined == 3, "three followers")
        finally:
            gate.opened.set()
        failed, rest, stream = leader.result(WAIT), [f.result(WAIT) for f in followers], twin.result(WAIT)
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
    texts = {content(r) for r in rest}  # no follower gets the leader's error: each ran on its own
    assert len(texts) == 1 and stream.text in texts and stream.text  # the bf16 engine is batch invariant
    assert held.opened == generations + 4
    for rid in [r.json()["id"] for r in rest] + [stream.id]:
        row = one_row(server, rid)
        assert (row.cache_status, row.status) == ("miss", "ok") and row.cost > 0
    assert released(server) == before + 3
    assert app_services(server.app).pipeline.flights.in_air(tid) == []


def test_a_leader_whose_client_leaves_releases_its_followers(server: LiveServer, held: HeldEngine) -> None:
    client, tid = tenant(server)
    leaving = httpx.Client(base_url=server.base_url, headers=client.headers, timeout=WAIT)
    generations = held.opened
    gate = held.hold_next(after=3)
    pool = ThreadPoolExecutor(4)
    try:
        with leaving.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r:
            leader_id = r.headers["x-request-id"]
            flight = flight_of(server, tid)
            followers: list[Future] = [pool.submit(chat, client) for _ in range(2)]
            followers.append(pool.submit(streamed, client))
            until(lambda: flight.joined == 3, "three followers")
        leaving.close()  # the leader's client hangs up while its generation is held
        # the followers finish on their own, though the leader's gate never opened
        until(lambda: all(f.done() for f in followers), "the released followers to finish")
        assert not gate.opened.is_set()
    finally:
        gate.opened.set()
        pool.shutdown()
    plain, stream = [f.result() for f in followers[:2]], followers[2].result()
    assert len({content(r) for r in plain} | {stream.text}) == 1
    assert one_row(server, leader_id).status == "aborted"
    for rid in [r.json()["id"] for r in plain] + [stream.id]:
        assert one_row(server, rid).cache_status == "miss"
    assert held.opened == generations + 4
    assert app_services(server.app).pipeline.flights.in_air(tid) == []


def test_other_tenants_parameters_and_no_cache_never_wait(server: LiveServer, held: HeldEngine) -> None:
    client, tid = tenant(server)
    other, _ = tenant(server)
    gate = held.hold_next()
    with ThreadPoolExecutor(8) as pool:
        try:
            leader = pool.submit(chat, client)
            flight = flight_of(server, tid)
            asks = [
                pool.submit(chat, other),  # another tenant
                pool.submit(chat, client, max_tokens=31),  # answer-changing parameters
                pool.submit(chat, client, seed=5),
                pool.submit(chat, client, stop=["\n\n"]),
                pool.submit(chat, client, cache="no-cache"),  # told not to read the cache
                pool.submit(chat, client, temperature=0.7),  # sampling: not cacheable
                pool.submit(chat, client, messages=[{"role": "user", "content": "Write a short poem about the sky."}]),
            ]
            # All answered while the leader is still held: none of them waited for it.
            statuses = [f.result(WAIT).headers["x-switchboard-cache"] for f in asks]
            assert not leader.done() and flight.joined == 0
        finally:
            gate.opened.set()
        assert leader.result(WAIT).status_code == 200
    assert statuses == ["miss"] * len(asks)
    assert {one_row(server, f.result().json()["id"]).cache_status for f in asks} <= {"miss", "bypass"}


def test_a_paraphrase_follows_with_the_semantic_cache(server: LiveServer, held: HeldEngine) -> None:
    client, tid = tenant(server, semantic=True)
    hits = flight_hits(server, "semantic")
    ask = lambda text: {"messages": [{"role": "user", "content": text}]}  # noqa: E731
    gate = held.hold_next()
    with ThreadPoolExecutor(4) as pool:
        try:
            leader = pool.submit(chat, client, **ask("How do I reverse a list in Python?"))
            flight = flight_of(server, tid)
            near_miss = pool.submit(chat, client, **ask("How do I reverse a list in Rust?"))
            assert near_miss.result(WAIT).headers["x-switchboard-cache"] == "miss"  # answered while the leader waits
            paraphrase = pool.submit(chat, client, **ask("What's the way to reverse a Python list?"))
            until(lambda: flight.joined == 1, "the paraphrase to follow")
        finally:
            gate.opened.set()
        first, second = leader.result(WAIT), paraphrase.result(WAIT)
    assert content(second) == content(first) and second.headers["x-switchboard-cache"] == "semantic-hit"
    assert second.headers["x-switchboard-cache-source"] == first.json()["id"]
    row = one_row(server, second.json()["id"])
    assert (row.cache_status, row.cost) == ("flight-sem-hit", 0)
    assert flight_hits(server, "semantic") == hits + 1


def test_a_refused_leader_releases_waiting_followers() -> None:
    """The registry alone: a leader refused at admission (or released any other way) wakes every follower,
    which goes on as the plain miss it would have been; a leader's answer reaches every follower."""
    settings = CacheSettings()
    key = request_key("chat.completions", "small", POEM, {"temperature": 0, "max_tokens": 32}, settings)
    miss = CacheDecision("miss", key=key, settings=settings)

    async def run() -> None:
        flights = Flights()
        first = await join(flights, None, 1, "leader", miss, stream=False)
        assert first.lead is not None and first.follow is None
        waiting = [asyncio.create_task(join(flights, None, 1, f"f{i}", miss, stream=i == 2)) for i in range(3)]
        other = await join(flights, None, 2, "other", miss, stream=False)  # another tenant leads its own
        assert other.lead is not None and other.lead is not first.lead
        await asyncio.sleep(0)
        assert first.lead.joined == 3 and not any(t.done() for t in waiting)
        first.lead.release()  # e.g. a 429 at its reservation
        seats = await asyncio.gather(*waiting)
        assert all(s.cache is miss and s.lead is None and s.follow is None for s in seats)
        assert flights.released == 3 and flights.in_air(1) == []

    asyncio.run(run())
