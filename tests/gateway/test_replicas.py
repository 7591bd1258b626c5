"""Two gateway replicas, real `switchboard serve` processes on one PostgreSQL database and one Redis
namespace, enforce one hard budget: 200 concurrent requests split between them never spend past it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from conftest import MODELS_HOME

import services
from core.db.database import Database
from core.db.models import Usage
from gateway.accounting.tenants import authenticate, create_tenant
from policies.budgets import Budgets
from policies.counters import RedisCounters
from policies.policy import Policy
from policies.pricing import Tokens, charge
from policies.store import PolicyStore

pytestmark = pytest.mark.slow

SWITCHBOARD = str(Path(sys.executable).parent / "switchboard")
QUESTION = [{"role": "user", "content": "Name the capital of France."}]
# Prices high enough that every request costs cents: "to the cent" then means something. Cached prompt
# tokens cost as much as the rest, so a request costs close to its worst case: a budget each replica
# counted on its own would let about twice as many through and overspend, which the test would see.
POLICY = {
    "prices": {"small": {"prompt": "1000", "cached_prompt": "1000", "completion": "1000"}},
    "counterfactual_tier": "small",
}
BUDGET = Decimal("2.60")  # about 60 worst cases: ~36 prompt tokens + 8 completion at these prices


def start_replica(env: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    port = services.free_port()
    with log.open("w") as out:
        proc = subprocess.Popen([SWITCHBOARD, "serve", "--port", str(port)], env=env, stdout=out, stderr=out)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture
def replicas(
    postgres_url: str, redis_server: str, redis_namespace: str, smollm2_dir: Path, tmp_path: Path
) -> Iterator[list[str]]:
    """Two `switchboard serve` processes sharing the database and the Redis namespace; their base URLs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    env.update(
        SWITCHBOARD_HOME=str(MODELS_HOME),  # the shared models cache: nothing is fetched again
        SWITCHBOARD_KEY_SECRET=os.environ["SWITCHBOARD_KEY_SECRET"],  # keys made here authenticate there
        SWITCHBOARD_CONFIG=str(tmp_path / "none.toml"),  # no switchboard.toml from the working directory
        SWITCHBOARD_DATABASE_URL=postgres_url,  # not the SQLite file the home would default to
        SWITCHBOARD_REDIS_URL=redis_server,
        SWITCHBOARD_REDIS_NAMESPACE=redis_namespace,
        SWITCHBOARD_TIERS__SMALL__MODEL="smollm2-135m-instruct",  # the tiny profile's tier,
        SWITCHBOARD_TIERS__SMALL__THREADS="1",  # on one thread each: two replicas share the machine
        SWITCHBOARD_LOG_LEVEL="warning",
        SWITCHBOARD_ROUTER_AUTO_TRAIN="false",  # no router trained into the shared home behind the budget test
    )
    db = Database(postgres_url)
    db.upgrade()  # once, here: two replicas migrating one fresh database at the same moment would race
    db.dispose()
    started = [start_replica(env, tmp_path / f"replica{i}.log") for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        for i, (proc, url) in enumerate(started):
            services.wait_serving(proc, f"{url}/healthz", tmp_path / f"replica{i}.log", deadline, "the replica", 0.2)
        yield [url for _, url in started]
    finally:
        for proc, _ in started:
            proc.terminate()
        for proc, _ in started:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


async def ask(http: httpx.AsyncClient, base_url: str, key: str, i: int) -> tuple[str, int, dict]:
    body = {"model": "small", "messages": QUESTION, "max_tokens": 8, "temperature": 1.0, "seed": i, "cache": "no-store"}
    r = await http.post(f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    return base_url, r.status_code, r.json()


def test_two_replicas_never_overspend_one_hard_budget(
    postgres_url: str, redis_server: str, redis_namespace: str, replicas: list[str]
) -> None:
    db = Database(postgres_url)
    key = create_tenant(db, "acme").key
    tenant = authenticate(db, key).tenant_id
    budget = {"budgets": [{"period": "daily", "money": str(BUDGET)}]}
    PolicyStore(db).save(tenant, Policy.model_validate({**POLICY, **budget}), "test")

    async def run() -> list[tuple[str, int, dict]]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(limits=limits, timeout=300) as http:
            return await asyncio.gather(*(ask(http, replicas[i % 2], key, i) for i in range(200)))

    outcomes = asyncio.run(run())
    ok = [body["id"] for _, status, body in outcomes if status == 200]
    refused = [body["error"] for _, status, body in outcomes if status == 429]
    assert len(ok) + len(refused) == 200, sorted({(s, str(b)[:200]) for _, s, b in outcomes if s not in (200, 429)})
    assert all(e["code"] == e["type"] == "insufficient_quota" for e in refused)
    by_replica = {url: sorted(s for u, s, _ in outcomes if u == url) for url in replicas}
    assert [len(answered) for answered in by_replica.values()] == [100, 100]  # both replicas took their half
    # Which replica admits first is the scheduler's call; what both must show together is served and refused.
    assert {s for _, s, _ in outcomes} == {200, 429}, {url: set(v) for url, v in by_replica.items()}

    with db.session() as s:
        rows = list(s.scalars(sa.select(Usage).where(Usage.tenant_id == tenant)))
    spent = sum((r.cost for r in rows), Decimal(0))
    assert sorted(r.request_id for r in rows) == sorted(ok)  # one row per 200, none for a 429
    assert 0 < spent <= BUDGET  # to the cent: exact Decimal
    worst = charge(Policy.model_validate(POLICY), "small", Tokens(rows[0].prompt_tokens, 8)).cost
    assert len(ok) >= BUDGET // worst  # each admitted request held its worst case until it settled

    async def counted() -> tuple[tuple[Decimal, int], tuple[Decimal, int], list[str]]:
        budgets = Budgets(db, RedisCounters(redis_server, redis_namespace), redis_namespace)
        try:
            held = [rid for rid in await budgets.counters.outstanding() if rid in ok]
            return await budgets.spent(tenant, "daily"), await budgets.spent(tenant, "monthly"), held
        finally:
            await budgets.counters.close()

    tokens = sum(r.prompt_tokens + r.completion_tokens for r in rows)
    assert asyncio.run(counted()) == ((spent, tokens), (spent, tokens), [])  # Redis equals SQL, all settled
    db.dispose()
