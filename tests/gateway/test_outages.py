"""Outages under load: Redis, then PostgreSQL, stops and starts again while clients keep calling a live
gateway. Nobody gets a 500; the only errors are the documented 503s; every request that was answered
has exactly one ledger row; and the budget counters end up equal to the ledger."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

import services
from core.db.database import Database
from core.db.models import ApiKey, Usage
from core.money import to_units
from engines.async_engine import AsyncEngine
from gateway.accounting.ledger import Ledger, UsageRecord
from gateway.accounting.tenants import AUTH_TTL, create_tenant, tenant_by_name
from gateway.api.deps import app_config, app_services
from live import LiveServer, serve_gateway
from policies.budgets import Budgets, period_window
from policies.counters import RedisCounters
from policies.policy import Policy

QUESTION = [{"role": "user", "content": "Name the capital of France."}]
PRICED = {
    "prices": {"small": {"prompt": "1000", "cached_prompt": "100", "completion": "2000"}},
    "counterfactual_tier": "small",
}
BUDGETED = {**PRICED, "budgets": [{"period": "daily", "money": "1000"}]}  # a hard budget nothing here reaches
CLIENTS_PER_TENANT = 4


@dataclass(frozen=True)
class Outcome:
    tenant: str
    status: int
    body: dict
    started: float  # time.monotonic()
    ended: float

    @property
    def code(self) -> str | None:
        return self.body["error"]["code"] if self.status != 200 else None


@dataclass(frozen=True)
class Outage:
    down: float  # time.monotonic() when the service stopped answering
    up: float  # ... and when it answered again


async def under_load(
    base_url: str, keys: dict[str, str], seconds: float, outage: Callable[[list[Outcome]], Awaitable[Outage]]
) -> tuple[list[Outcome], Outage]:
    """CLIENTS_PER_TENANT clients per tenant call the gateway back to back for `seconds`, and at least until
    `outage` (shown the outcomes so far) is over and 2 s more."""
    outcomes: list[Outcome] = []
    until = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient, tenant: str, n: int) -> None:
        while time.monotonic() < until:  # read each time: raised below once the outage is over
            n += 1000
            body = {
                "model": "small",
                "messages": QUESTION,
                "max_tokens": 4,
                "temperature": 1.0,
                "seed": n,
                "cache": "no-store",  # every request runs: the response cache does not answer
            }
            started = time.monotonic()
            r = await http.post(
                f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {keys[tenant]}"}
            )
            outcomes.append(Outcome(tenant, r.status_code, r.json(), started, time.monotonic()))

    async with httpx.AsyncClient(timeout=120) as http:
        clients = [asyncio.create_task(client(http, tenant, i)) for tenant in keys for i in range(CLIENTS_PER_TENANT)]
        happened = await outage(outcomes)
        until = max(until, time.monotonic() + 2)
        await asyncio.gather(*clients)
    return outcomes, happened


def tenant_with(live: LiveServer, name: str, policy: dict) -> tuple[str, int]:
    """A tenant, its key and its policy; the key is not authenticated yet (this process shares the cache)."""
    key = create_tenant(live.db, name).key
    tenant = tenant_by_name(live.db, name)
    assert tenant is not None
    app_services(live.app).policies.save(tenant.id, Policy.model_validate(policy), "test")
    return key, tenant.id


def assert_openai_error(outcome: Outcome) -> None:
    assert set(outcome.body) == {"error"} and {"message", "type", "param", "code"} <= set(outcome.body["error"])


def ledger_rows(db: Database, tenant_ids: list[int]) -> dict[str, int]:
    """Request id → how many rows it has, for these tenants."""
    with db.session() as s:
        ids = s.scalars(sa.select(Usage.request_id).where(Usage.tenant_id.in_(tenant_ids))).all()
    counts: dict[str, int] = {}
    for rid in ids:
        counts[rid] = counts.get(rid, 0) + 1
    return counts


def counters_match_ledger(db: Database, redis_url: str, namespace: str, tenant_ids: list[int]) -> bool:
    """Whether the Redis counters (daily and monthly, money and tokens) equal the ledger's totals. Read
    as they are: a missing counter is a mismatch, not something to load from SQL here."""

    async def read() -> bool:
        budgets = Budgets(db, RedisCounters(redis_url, namespace), namespace)
        today = datetime.now(UTC).date()
        try:
            for tid in tenant_ids:
                with db.session() as s:
                    rows = s.execute(
                        sa.select(Usage.cost, Usage.prompt_tokens + Usage.completion_tokens).where(
                            Usage.tenant_id == tid
                        )
                    ).all()
                truth = {"money": to_units(sum((c for c, _ in rows), Decimal(0))), "tokens": sum(t for _, t in rows)}
                for period in ("daily", "monthly"):
                    window, _, _ = period_window(period, today)
                    for unit, value in truth.items():
                        if await budgets.counters.get(budgets.spend_key(tid, period, window, unit)) != value:
                            return False
            return True
        finally:
            await budgets.counters.close()

    return asyncio.run(read())


def eventually(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


# --- Redis ------------------------------------------------------------------------------------------


@pytest.fixture
def own_redis() -> Iterator[services.RedisServer]:
    server = services.RedisServer()
    server.start()
    yield server
    server.stop()


def usage(tenant_id: int, request_id: str, cost: str, tokens: int) -> UsageRecord:
    return UsageRecord.from_columns(request_id, tenant_id, None, "chat.completions", "m", "small", tokens, 0, 5, "ok",
                                    "stop", cost=Decimal(cost))  # fmt: skip


def test_counters_rebuilt_exactly_after_redis_comes_back_empty(
    database: Database, own_redis: services.RedisServer, tmp_path: Path
) -> None:
    """The ledger commits a request's row before its reservation is settled. Across a Redis that restarts
    empty, settlements of lost reservations add nothing (the counters were loaded from SQL without
    them), requests served uncounted are counted from SQL, and a row whose reservation is still held
    counts once, as its reservation, until it settles."""
    tenant = tenant_by_name(database, create_tenant(database, "acme").tenant)
    assert tenant is not None
    ledger = Ledger(database, tmp_path / "spool.jsonl")
    hard = Policy.model_validate({"budgets": [{"period": "daily", "money": "100"}]})
    free = Policy()

    async def spent(budgets: Budgets) -> tuple[Decimal, int]:
        await asyncio.sleep(0)
        while budgets.rebuilding:  # let a rebuild in the background finish
            await asyncio.sleep(0.05)
        return await budgets.spent(tenant.id, "daily")

    async def run() -> None:
        budgets = Budgets(database, RedisCounters(own_redis.url, "t"), "t")
        lost = await budgets.admit("lost", hard, tenant.id, 0, Decimal("0.50"), 100)
        ledger.record(usage(tenant.id, "lost", "0.25", 40))
        own_redis.stop()
        uncounted = await budgets.admit("uncounted", free, tenant.id, 0, Decimal("0.50"), 100)
        assert uncounted.items == []  # no limit to enforce: served while Redis is down
        ledger.record(usage(tenant.id, "uncounted", "0.125", 20))
        await budgets.settle(lost, Decimal("0.25"), 40)  # fails: kept to retry
        await asyncio.sleep(budgets.RETRY_AFTER)  # the backoff after the failure
        own_redis.start()  # empty
        held = await budgets.admit("held", hard, tenant.id, 0, Decimal("0.50"), 100)  # loads SQL, then rebuilds
        assert await spent(budgets) == (Decimal("0.875"), 160)  # SQL (0.25 + 0.125) + the held worst case
        await budgets.settle(uncounted, Decimal("0.125"), 20)  # already in SQL: must not count twice
        assert await spent(budgets) == (Decimal("0.875"), 160)
        ledger.record(usage(tenant.id, "held", "0.0625", 10))  # committed, not settled yet
        assert await budgets.reconcile() == 4
        assert await spent(budgets) == (Decimal("0.875"), 160)  # the row counts as its reservation, once
        await budgets.settle(held, Decimal("0.0625"), 10)
        assert await spent(budgets) == (Decimal("0.4375"), 70)  # exactly the ledger
        version = budgets.version_key(tenant.id)
        seen = await budgets.counters.get(version)
        await budgets.admit("late", hard, tenant.id, 0, Decimal("0.01"), 1)  # a reservation races a rebuild
        assert not await budgets.counters.rebuild(version, seen, {"t:x": (1, 60)})  # which then reads again
        await budgets.counters.close()

    asyncio.run(run())


def test_budgeted_requests_are_admitted_as_soon_as_redis_is_back(
    database: Database, own_redis: services.RedisServer
) -> None:
    """Every pooled connection is dead after Redis restarts. Each is replaced as it is used, without
    failing the request it carries or starting a backoff: a budget is refused only while Redis is down."""
    tenant = tenant_by_name(database, create_tenant(database, "acme").tenant)
    assert tenant is not None
    hard = Policy.model_validate({"budgets": [{"period": "daily", "money": "100"}]})

    async def run() -> None:
        budgets = Budgets(database, RedisCounters(own_redis.url, "t"), "t")

        async def admit_many(tag: str) -> list:
            return await asyncio.gather(
                *(budgets.admit(f"{tag}{i}", hard, tenant.id, 0, Decimal("0.01"), 1) for i in range(8))
            )

        await admit_many("before")  # eight pooled connections
        own_redis.stop()
        own_redis.start()  # empty, on the same port: the pool's sockets are all closed by the old server
        after = await admit_many("after")
        assert all(r.items for r in after)  # counted, none refused
        assert await budgets.counters.outstanding() and not budgets.backing_off
        await budgets.counters.close()

    asyncio.run(run())


@pytest.mark.slow
def test_redis_restarting_under_load(
    small_engine: AsyncEngine, postgres_url: str, own_redis: services.RedisServer, tmp_path: Path
) -> None:
    """Redis stops for a few seconds and comes back empty. The budgeted tenant gets 503
    budget_unavailable meanwhile and is served again after; the unbudgeted one is served throughout;
    its uncounted usage and the budgeted tenant's lost counters are rebuilt from SQL."""
    live, stop = serve_gateway(small_engine, tmp_path, postgres_url, redis_url=own_redis.url)
    try:
        keys, ids = {}, {}
        for name, policy in (("budgeted", BUDGETED), ("free", PRICED)):
            keys[name], ids[name] = tenant_with(live, name, policy)

        async def outage(_: list[Outcome]) -> Outage:
            await asyncio.sleep(3)
            down = time.monotonic()
            await asyncio.to_thread(own_redis.stop)
            await asyncio.sleep(4)
            await asyncio.to_thread(own_redis.start)  # the same port, nothing in it
            return Outage(down, time.monotonic())

        outcomes, out = asyncio.run(under_load(live.base_url, keys, 14, outage))

        errors = [o for o in outcomes if o.status != 200]
        for o in errors:
            assert_openai_error(o)
        assert {(o.tenant, o.status, o.code) for o in errors} == {("budgeted", 503, "budget_unavailable")}
        assert all(o.ended > out.down and o.started < out.up + 2 for o in errors)  # only while Redis was down
        # Asked while Redis was down (admission is when the budget would be checked): on a busy 2-vCPU box an
        # answer can take longer than the 4 s outage, so none need also end inside it.
        during = [o for o in outcomes if o.tenant == "free" and out.down < o.started < out.up]
        assert during and all(o.status == 200 for o in during)  # served throughout, uncounted
        after = [o for o in outcomes if o.tenant == "budgeted" and o.started > out.up + 2]
        assert after and all(o.status == 200 for o in after)  # counted again once Redis is back

        answered = [o.body["id"] for o in outcomes if o.status == 200]
        rows = ledger_rows(live.db, list(ids.values()))
        assert sorted(rows) == sorted(answered) and set(rows.values()) == {1}  # one row each, none for a 503
        ns = app_config(live.app).settings.redis_namespace
        assert eventually(lambda: counters_match_ledger(live.db, own_redis.url, ns, list(ids.values())), 15)
    finally:
        stop()


# --- PostgreSQL ---------------------------------------------------------------------------------------


@pytest.fixture
def own_postgres() -> Iterator[services.PostgresCluster]:
    cluster = services.PostgresCluster()
    cluster.start()
    cluster.create_test_database()
    yield cluster
    cluster.remove()


@pytest.mark.slow
def test_postgres_restarting_under_load(
    small_engine: AsyncEngine,
    own_postgres: services.PostgresCluster,
    redis_server: str,
    tmp_path: Path,
) -> None:
    """PostgreSQL stops for a few seconds and starts again. Keys and policies seen recently keep being
    served, usage rows wait in the spool and reach the database once it is back (none lost, none
    twice), a key never seen gets a 503 meanwhile, and the gateway recovers by itself: new
    connections, a new key, a revocation honoured."""
    live, stop = serve_gateway(small_engine, tmp_path, own_postgres.url(), redis_url=redis_server)
    ns = app_config(live.app).settings.redis_namespace
    try:
        keys, ids = {}, {}
        for name, policy in (("budgeted", BUDGETED), ("free", PRICED)):
            keys[name], ids[name] = tenant_with(live, name, policy)
        unseen, unseen_id = tenant_with(live, "unseen", PRICED)  # authenticates first during the outage
        admin = {"Authorization": f"Bearer {create_tenant(live.db, 'ops', operator=True, role='admin').key}"}
        assert httpx.get(f"{live.base_url}/v1/admin/tenants", headers=admin).status_code == 200  # a key seen
        checks: dict[str, httpx.Response] = {}

        async def outage(outcomes: list[Outcome]) -> Outage:
            await asyncio.sleep(3)
            down = time.monotonic()
            await asyncio.to_thread(own_postgres.stop, "fast")
            await asyncio.sleep(AUTH_TTL + 1)  # past the fresh-key window: keys now come from the stale cache
            async with httpx.AsyncClient(timeout=60) as http:
                checks["unseen"] = await http.post(
                    f"{live.base_url}/v1/chat/completions",
                    json={"model": "small", "messages": QUESTION, "max_tokens": 2},
                    headers={"Authorization": f"Bearer {unseen}"},
                )
                checks["admin"] = await http.get(f"{live.base_url}/v1/admin/tenants", headers=admin)
            await asyncio.sleep(1)
            # down until each tenant has had a request start and finish on the stale cache (a slower CPU, a
            # Zen 3, took longer than the second above), 20 s at most
            settled = down + AUTH_TTL + 0.5
            for _ in range(200):
                if {o.tenant for o in outcomes if o.started > settled} >= set(keys):
                    break
                await asyncio.sleep(0.1)
            await asyncio.to_thread(own_postgres.start)
            return Outage(down, time.monotonic())

        outcomes, out = asyncio.run(under_load(live.base_url, keys, 14, outage))

        assert [o for o in outcomes if o.status != 200] == []  # recent keys and policies served throughout
        during = [o for o in outcomes if o.started > out.down + AUTH_TTL + 0.5 and o.ended < out.up]
        assert {o.tenant for o in during} == {"budgeted", "free"}  # ... including while the database was down
        for refused in checks.values():  # a key never seen; an admin call that needs the database itself
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "database_unavailable"
            assert set(refused.json()["error"]) >= {"message", "type", "param", "code"}

        answered = sorted(o.body["id"] for o in outcomes)
        assert eventually(lambda: sorted(ledger_rows(live.db, list(ids.values()))) == answered, 30)  # the spool drained
        assert set(ledger_rows(live.db, list(ids.values())).values()) == {1}
        assert not list(tmp_path.glob("usage-spool*.jsonl"))
        assert eventually(lambda: counters_match_ledger(live.db, redis_server, ns, list(ids.values())), 10)

        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            body = {"model": "small", "messages": QUESTION, "max_tokens": 2, "cache": "no-store"}
            late = http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {unseen}"})
            assert late.status_code == 200  # new connections, and a key checked against the database again
            assert live.wait_for_usage(late.json()["id"])[0].tenant_id == unseen_id
            with live.db.session() as s:  # revoked behind this process's back, as another replica would
                s.execute(sa.update(ApiKey).where(ApiKey.tenant_id == ids["free"]).values(revoked_at=sa.func.now()))
            headers = {"Authorization": f"Bearer {keys['free']}"}
            assert eventually(
                lambda: http.post("/v1/chat/completions", json=body, headers=headers).status_code == 401, 5
            )
    finally:
        stop()
        services.delete_namespace(redis_server, ns)
