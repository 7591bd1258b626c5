"""Budgets and billing through a live gateway on real Redis, with SQLite and PostgreSQL ledgers:
concurrent requests cannot overspend a hard budget, streamed and plain requests cost the same, an
aborted stream is billed for what it generated, rate limits answer 429 with retry-after."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from decimal import Decimal

import httpx
import openai
import pytest
import sqlalchemy as sa

import services
from core.db.models import Usage
from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import authenticate
from gateway.api.deps import app_services
from live import LiveServer, serve_gateway
from policies.policy import Policy
from policies.pricing import Tokens, charge

QUESTION = [{"role": "user", "content": "Name the capital of France."}]
# Prices high enough that every request costs cents: "to the cent" then means something.
PRICES = {"small": {"prompt": "1000", "cached_prompt": "100", "completion": "2000"}}
POLICY = {"prices": PRICES, "counterfactual_tier": "small"}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(
    request: pytest.FixtureRequest, small_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    home = tmp_path_factory.mktemp("home")
    if request.param == "sqlite":
        url, drop = f"sqlite:///{home / 'switchboard.db'}", None
    else:
        url, drop = services.create_database(request.getfixturevalue("postgres_server"))
    live, stop = serve_gateway(small_engine, home, url, redis_url=request.getfixturevalue("redis_server"))
    yield live
    stop()
    if drop:
        drop()


def tenant_with(live: LiveServer, policy: dict) -> tuple[str, int]:
    key = live.new_key()
    who = authenticate(live.db, key)
    app_services(live.app).policies.save(who.tenant_id, Policy.model_validate({**POLICY, **policy}), "test")
    return key, who.tenant_id


def ledger(live: LiveServer, tenant_id: int) -> list[Usage]:
    with live.db.session() as s:
        return list(s.scalars(sa.select(Usage).where(Usage.tenant_id == tenant_id)))


def counted(live: LiveServer, tenant_id: int) -> tuple[Decimal, int]:
    """What the Redis counters say this tenant spent today."""
    budgets = app_services(live.app).budgets

    async def read() -> tuple[Decimal, int]:
        from policies.budgets import Budgets
        from policies.counters import RedisCounters

        fresh = Budgets(live.db, RedisCounters(services.redis_url(), budgets.ns), budgets.ns)  # this loop's client
        try:
            return await fresh.spent(tenant_id, "daily")
        finally:
            await fresh.counters.close()

    return asyncio.run(read())


def test_concurrent_plain_and_streamed_requests_never_overspend_a_hard_budget(server: LiveServer) -> None:
    budget = Decimal("2.60")  # about 50 worst cases: ~36 prompt tokens + 8 completion at these prices
    key, tenant = tenant_with(server, {"budgets": [{"period": "daily", "money": str(budget)}]})

    async def ask(client: openai.AsyncOpenAI, i: int) -> str:
        try:
            body: dict = {"model": "small", "messages": QUESTION, "max_tokens": 8, "temperature": 1.0, "seed": i}
            if i % 2:  # half of them streamed: a stream's reservation is settled when it ends, like any other
                stream = await client.chat.completions.create(
                    **body, stream=True, stream_options={"include_usage": True}
                )
                usage = [chunk.usage async for chunk in stream if chunk.usage]
                assert len(usage) == 1 and usage[0].completion_tokens > 0
            else:
                await client.chat.completions.create(**body)
            return "ok"
        except openai.RateLimitError as exc:
            assert exc.status_code == 429 and exc.code == "insufficient_quota", exc.body
            return "quota"

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1",
            api_key=key,
            max_retries=0,
            timeout=300,
            http_client=httpx.AsyncClient(limits=limits, timeout=300),
        ) as client:
            return await asyncio.gather(*(ask(client, i) for i in range(200)))

    outcomes = asyncio.run(run())
    rows = ledger(server, tenant)
    spent = sum((r.cost for r in rows), Decimal(0))
    assert outcomes.count("ok") + outcomes.count("quota") == 200
    assert len(rows) == outcomes.count("ok")  # every request that ran has its one row; refused ones none
    assert outcomes.count("ok") < 200 and spent <= budget  # to the cent: exact Decimal
    worst = charge(
        Policy.model_validate(POLICY),
        "small",
        Tokens(rows[0].prompt_tokens, 8),
    ).cost
    # each admitted request held its worst case until it settled: at least that many fit
    assert outcomes.count("ok") >= budget // worst
    assert counted(server, tenant) == (spent, sum(r.prompt_tokens + r.completion_tokens for r in rows))


def test_streamed_and_plain_requests_cost_the_same(server: LiveServer) -> None:
    key, tenant = tenant_with(server, {})
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)
    run = {"extra_body": {"cache": "no-store"}}  # the engine runs every time: billing is what is compared
    client.chat.completions.create(model="small", messages=QUESTION, max_tokens=12, temperature=0, **run)  # warm KV
    plain = client.chat.completions.create(model="small", messages=QUESTION, max_tokens=12, temperature=0, **run)
    chunks = list(
        client.chat.completions.create(
            model="small",
            messages=QUESTION,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **run,
        )
    )
    streamed_usage = chunks[-1].usage
    assert (streamed_usage.prompt_tokens, streamed_usage.completion_tokens) == (
        plain.usage.prompt_tokens,
        plain.usage.completion_tokens,
    )
    a, b = server.wait_for_usage(plain.id)[0], server.wait_for_usage(chunks[0].id)[0]
    assert a.cost == b.cost > 0 and a.cached_prompt_tokens == b.cached_prompt_tokens > 0
    policy = Policy.model_validate(POLICY)
    tokens = Tokens(a.prompt_tokens, a.completion_tokens, cached_prompt=a.cached_prompt_tokens)
    assert a.cost == charge(policy, "small", tokens).cost  # priced from what ran
    assert a.counterfactual_cost - a.cost == a.saved_cache + a.saved_routing + a.saved_policy
    assert counted(server, tenant)[0] == sum((r.cost for r in ledger(server, tenant)), Decimal(0))


def test_an_aborted_stream_is_billed_for_what_it_generated(server: LiveServer) -> None:
    key, tenant = tenant_with(server, {"budgets": [{"period": "monthly", "money": "100"}]})
    body = {"model": "small", "messages": QUESTION, "max_tokens": 400, "temperature": 1.0, "seed": 3, "stream": True}
    seen, rid = 0, None
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", f"{server.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as r,
    ):
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                seen += 1
                if seen == 5:
                    break  # hang up mid-stream
    (row,) = server.wait_for_usage(rid)
    assert row.status == "aborted" and 5 <= row.completion_tokens < 400
    policy = Policy.model_validate(POLICY)
    tokens = Tokens(row.prompt_tokens, row.completion_tokens, cached_prompt=row.cached_prompt_tokens)
    assert row.cost == charge(policy, "small", tokens).cost > 0
    deadline = time.monotonic() + 10  # the reservation (400 tokens' worth) is settled to the actual cost
    while counted(server, tenant)[0] != row.cost and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counted(server, tenant) == (row.cost, row.prompt_tokens + row.completion_tokens)


def test_rate_limits_answer_429_with_retry_after(server: LiveServer) -> None:
    key, _ = tenant_with(server, {"rate_limits": {"key_rpm": 2}})
    if time.time() % 60 > 55:  # the three requests must share one minute window
        time.sleep(60 - time.time() % 60 + 0.1)
    body = {"model": "small", "messages": QUESTION, "max_tokens": 2}
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        codes = [http.post("/v1/chat/completions", json=body) for _ in range(3)]
    assert [c.status_code for c in codes] == [200, 200, 429]
    err = codes[2].json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error" and "2 requests" in err["message"]
    assert 1 <= int(codes[2].headers["retry-after"]) <= 60
