"""The verifier cascade through a live gateway, on SQLite and PostgreSQL: an answer that fails the tenant's
checks is retried on the large tier, and both attempts are billed, once each, also when the retry fails or
its client leaves; the budget counters then hold what the ledger billed. Both tiers are SmolLM2 (they
differ in name, price and ledger row, which is what the cascade's accounting is about); the large one is
held or failed by the test (`held_engine.HeldEngine`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal

import httpx
import pytest
import sqlalchemy as sa
from held_engine import HeldEngine

import services
from core.db.database import Database
from core.db.models import Usage
from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import authenticate, create_key, create_tenant
from gateway.api.deps import app_services
from live import LiveServer, start_server

POLICY = {"verifiers": {"checks": ["math"], "cascade": True, "cascade_to": "large"}}


@pytest.fixture(scope="module")
def large(small_engine: AsyncEngine) -> HeldEngine:
    """The large tier: the same SmolLM2, whose next generation a test can hold or fail."""
    return HeldEngine(small_engine)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def live(
    request: pytest.FixtureRequest,
    small_engine: AsyncEngine,
    large: HeldEngine,
    redis_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LiveServer]:
    from answer_samples import apple_answers

    from core.settings import Settings
    from gateway.app import create_app
    from router_model.encoder import RouterEncoder
    from verifiers.probe import AnswerProbe

    home = tmp_path_factory.mktemp("cascade")
    AnswerProbe.train(*apple_answers(), RouterEncoder()).save(home / "probe")  # the gateway loads it from home
    if request.param == "sqlite":
        url, drop = f"sqlite:///{home / 'switchboard.db'}", None
    else:
        url, drop = services.create_database(request.getfixturevalue("postgres_server"))
    db = Database(url)
    settings = Settings(
        home=home,
        database_url=url,
        redis_url=redis_server,  # budgets counted in Redis, as replicas share them
        redis_namespace=f"sbtest-{uuid.uuid4().hex[:10]}",
        tiers={"small": {"model": "unused"}, "large": {"model": "unused"}},
    )
    engines = {"small": small_engine, "large": large}
    server, stop = start_server(create_app(settings, engines=engines, database=db), db)  # type: ignore[arg-type]
    yield server
    stop()
    db.dispose()
    if drop:
        drop()


def tenant_key(live: LiveServer, policy: dict) -> str:
    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = create_tenant(live.db, name, role="admin").key
    r = httpx.put(
        f"{live.base_url}/v1/admin/tenants/{name}/policy", json=policy, headers={"Authorization": f"Bearer {admin}"}
    )
    assert r.status_code == 200, r.text
    return create_key(live.db, name, "app").key


def ask(live: LiveServer, key: str, content: str, **extra: object) -> httpx.Response:
    body = {"model": "small", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 40}
    return httpx.post(
        f"{live.base_url}/v1/chat/completions",
        json={**body, "cache": "no-store", **extra},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def test_a_failed_answer_is_retried_on_the_large_tier_and_both_are_billed(live: LiveServer) -> None:
    key = tenant_key(live, POLICY)
    r = ask(live, key, "Say hello to my friend Anna in one short sentence.")  # no number: the math check fails
    assert r.status_code == 200, r.text
    assert r.headers["x-switchboard-tier"] == "large"
    first_id = r.headers["x-switchboard-cascade"].split("first=")[1]
    assert r.headers["x-switchboard-cascade"].startswith("small>large")
    assert "0:math:escalate@" in r.headers["x-switchboard-verifiers"]
    (first,) = live.wait_for_usage(first_id)
    (second,) = live.wait_for_usage(r.json()["id"])
    assert (first.tier, first.status, second.tier, second.status) == ("small", "escalated", "large", "ok")
    assert first.cost > 0 and first.counterfactual_cost == Decimal(0)  # it only cost: the cascade's overhead
    levers = ("saved_routing", "saved_cache", "saved_speculation", "saved_policy", "saved_verifier")
    for row in (first, second):
        assert row.counterfactual_cost - row.cost == sum(getattr(row, k) for k in levers)
    assert second.cost > 0 and second.counterfactual_cost >= second.cost
    assert first.verifier_actions[0]["action"] == "escalate" and r.json()["usage"] == {
        "prompt_tokens": second.prompt_tokens,
        "completion_tokens": second.completion_tokens,
        "total_tokens": second.prompt_tokens + second.completion_tokens,
    }


def test_an_answer_that_passes_is_not_retried(live: LiveServer) -> None:
    key = tenant_key(live, POLICY)
    r = ask(live, key, "What is 2 + 2? Reply with the number.")
    assert r.status_code == 200 and r.headers["x-switchboard-tier"] == "small"
    assert "x-switchboard-cascade" not in r.headers and r.headers["x-switchboard-verifiers"] == "none"
    (row,) = live.wait_for_usage(r.json()["id"])
    assert row.status == "ok" and row.tier == "small"
    # streams are not cascaded (what was streamed cannot be taken back), but the check is still recorded
    s = ask(live, key, "Say hello to my friend Anna in one short sentence.", stream=True)
    assert s.status_code == 200 and s.headers["x-switchboard-tier"] == "small"
    rid = next(line for line in s.text.splitlines() if line.startswith("data: {"))
    request_id = httpx.Response(200, content=rid[6:]).json()["id"]
    (row,) = live.wait_for_usage(request_id)
    assert row.status == "ok" and row.verifier_actions[0]["action"] == "escalate"


def test_without_a_cascade_the_failed_check_is_only_reported(live: LiveServer) -> None:
    key = tenant_key(live, {"verifiers": {"checks": ["math"], "cascade": False}})
    r = ask(live, key, "Say hello to my friend Anna in one short sentence.")
    assert r.headers["x-switchboard-tier"] == "small" and "x-switchboard-cascade" not in r.headers
    assert "0:math:escalate@" in r.headers["x-switchboard-verifiers"]


def test_an_answer_that_failed_its_check_is_never_cached(live: LiveServer) -> None:
    """Without a cascade the failed answer goes out, but a repeat of the request runs again instead of
    replaying it; an answer that passed is replayed."""
    key = tenant_key(live, {"verifiers": {"checks": ["math"], "cascade": False}})

    def twice(content: str) -> list[httpx.Response]:
        return [ask(live, key, content, cache="default") for _ in range(2)]

    failed = twice(f"Say hello to my friend Anna in one short sentence. ({uuid.uuid4().hex[:6]})")
    assert all("0:math:escalate@" in r.headers["x-switchboard-verifiers"] for r in failed)
    assert [r.headers.get("x-switchboard-cache") for r in failed] == ["miss", "miss"]
    passed = twice(f"What is 2 + 2? Reply with the number. ({uuid.uuid4().hex[:6]})")
    assert passed[0].headers["x-switchboard-verifiers"] == "none"
    assert [r.headers.get("x-switchboard-cache") for r in passed] == ["miss", "hit"]


# The docstring says sum, the example says otherwise: any answer that follows the text fails it.
CODE_PROMPT = """Complete this Python function. Reply with the code only.

def add(a, b):
    \"\"\"Return the sum of a and b.
    >>> add(2, 3)
    7
    \"\"\"
"""


def test_the_default_policy_runs_a_code_answer_against_its_prompts_examples(live: LiveServer) -> None:
    """No policy saved: a code answer that fails the examples its prompt gives is retried on large, and the
    failed answer is not cached (a repeat runs and escalates again); an answer without examples to run
    goes out as it is."""
    key = tenant_key(live, {})
    runs = [ask(live, key, CODE_PROMPT, cache="default", max_tokens=60) for _ in range(2)]
    for r in runs:
        assert r.status_code == 200, r.text
        assert r.headers["x-switchboard-cascade"].startswith("small>large"), r.headers.get("x-switchboard-verifiers")
        assert "0:prompt_examples:escalate@" in r.headers["x-switchboard-verifiers"]
        assert r.headers.get("x-switchboard-cache") != "hit"
        (first,) = live.wait_for_usage(r.headers["x-switchboard-cascade"].split("first=")[1])
        assert (first.tier, first.status) == ("small", "escalated")
    plain = ask(live, key, "Say hello to my friend Anna in one short sentence.")
    assert plain.headers["x-switchboard-tier"] == "small" and "x-switchboard-cascade" not in plain.headers


@pytest.mark.parametrize(("threshold", "escalated"), [(1.0, True), (0.0, False)])
def test_the_probe_check_escalates_below_its_threshold(live: LiveServer, threshold: float, escalated: bool) -> None:
    policy = {"verifiers": {"checks": ["probe"], "probe_threshold": threshold, "cascade": True}}
    r = ask(live, tenant_key(live, policy), "What is 2 + 2? Reply with the number.")
    assert r.status_code == 200, r.text
    assert r.headers["x-switchboard-tier"] == ("large" if escalated else "small")
    if escalated:  # P(right) < 1.0 always: the probe's own P is in the reason
        assert "0:probe:escalate@" in r.headers["x-switchboard-verifiers"]
        (first,) = live.wait_for_usage(r.headers["x-switchboard-cascade"].split("first=")[1])
        assert first.verifier_actions[0]["reason"].startswith("P(right) ")
    else:
        assert r.headers["x-switchboard-verifiers"] == "none"


# --- the retry failing or cancelled: each attempt billed once, the counters equal the ledger -------------------

BUDGETED = {**POLICY, "budgets": [{"period": "monthly", "money": "100"}]}
HELLO = "Say hello to my friend Anna in one short sentence."  # no number: the math check fails


def tenant_rows(live: LiveServer, key: str) -> list[Usage]:
    who = authenticate(live.db, key)
    assert who is not None
    with live.db.session() as s:
        return list(s.scalars(sa.select(Usage).where(Usage.tenant_id == who.tenant_id).order_by(Usage.created_at)))


def settled(live: LiveServer, key: str, rows: int) -> list[Usage]:
    """The tenant's ledger rows once there are `rows` of them, each settled (billed once: `wait_for_usage`)."""
    deadline = time.monotonic() + 30
    while len(found := tenant_rows(live, key)) < rows and time.monotonic() < deadline:
        time.sleep(0.05)
    for row in found:
        live.wait_for_usage(row.request_id)
    return tenant_rows(live, key)


def counted(live: LiveServer, key: str) -> tuple[Decimal, int]:
    """What the budget counters hold for the tenant this month (reservations in flight included)."""
    from policies.budgets import Budgets
    from policies.counters import RedisCounters

    who = authenticate(live.db, key)
    assert who is not None
    budgets = app_services(live.app).budgets

    async def read() -> tuple[Decimal, int]:
        fresh = Budgets(live.db, RedisCounters(services.redis_url(), budgets.ns), budgets.ns)  # this loop's client
        try:
            return await fresh.spent(who.tenant_id, "monthly")
        finally:
            await fresh.counters.close()

    return asyncio.run(read())


def counters_equal_the_ledger(live: LiveServer, key: str, rows: list[Usage]) -> None:
    """Once every reservation is settled, the counters hold exactly what the ledger billed."""
    ledger = (sum((r.cost for r in rows), Decimal(0)), sum(r.prompt_tokens + r.completion_tokens for r in rows))
    deadline = time.monotonic() + 10
    while counted(live, key) != ledger and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counted(live, key) == ledger


def test_a_retry_that_fails_leaves_the_first_answer_and_two_rows(live: LiveServer, large: HeldEngine) -> None:
    key = tenant_key(live, BUDGETED)
    gate = large.hold_next(after=1, fail=True)  # the retry's engine errs after its first output
    gate.opened.set()
    r = ask(live, key, HELLO)
    assert r.status_code == 200, r.text  # the first answer stands
    assert r.headers["x-switchboard-tier"] == "small"
    first_id = r.json()["id"]
    rows = settled(live, key, 2)
    assert [(row.tier, row.status) for row in rows] == [("small", "escalated"), ("large", "error")]
    assert rows[0].request_id == first_id and all(row.cost > 0 for row in rows)  # the error ran: billed
    assert r.json()["usage"]["completion_tokens"] == rows[0].completion_tokens
    counters_equal_the_ledger(live, key, rows)


def test_a_client_that_leaves_during_the_retry_is_billed_for_both_attempts_once(
    live: LiveServer, large: HeldEngine
) -> None:
    key = tenant_key(live, BUDGETED)
    gate = large.hold_next(after=2)  # the retry holds after two outputs until the client has gone
    opened = large.opened

    async def leave() -> None:
        async with httpx.AsyncClient(base_url=live.base_url, timeout=120) as client:
            body = {"model": "small", "messages": [{"role": "user", "content": HELLO}], "temperature": 0}
            post = client.post(
                "/v1/chat/completions",
                json={**body, "max_tokens": 40, "cache": "no-store"},
                headers={"Authorization": f"Bearer {key}"},
            )
            task = asyncio.create_task(post)
            while large.opened == opened:  # the retry has started on the large tier
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # its first outputs pass, then it is held
            task.cancel()  # the client hangs up
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(leave())
    try:
        rows = settled(live, key, 2)
    finally:
        gate.opened.set()
    assert [(row.tier, row.status) for row in rows] == [("small", "escalated"), ("large", "aborted")]
    assert rows[1].completion_tokens < 40 and all(row.cost > 0 for row in rows)
    counters_equal_the_ledger(live, key, rows)
