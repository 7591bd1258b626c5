"""Policies, prices, counters and budgets as units: pydantic validation, Decimal pricing, atomic
reservations on real Redis and in-process, seeding and reconciliation from SQL (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from pydantic import ValidationError

from core.db.database import Database
from core.money import UNITS, from_units, to_units
from gateway.accounting.ledger import Ledger, UsageRecord, rebuild_rollup
from gateway.accounting.reports import costs, savings
from gateway.accounting.tenants import authenticate, create_tenant
from policies.budgets import Budgets, period_window
from policies.counters import Item, LocalCounters, Missing, RedisCounters
from policies.dry_run import replay
from policies.policy import Policy
from policies.pricing import Tokens, charge, worst_case
from policies.store import PolicyError, PolicyStore

D = Decimal


def test_policy_validation_names_each_bad_field() -> None:
    with pytest.raises(ValidationError) as info:
        Policy.model_validate(
            {"sampling": {"max_tokens_cap": 0, "temprature_max": 1}, "budgets": [{"period": "weekly", "money": 1}]}
        )
    locs = {tuple(e["loc"]) for e in info.value.errors()}
    assert ("sampling", "max_tokens_cap") in locs and ("sampling", "temprature_max") in locs  # typos are errors
    assert ("budgets", 0, "period") in locs
    with pytest.raises(ValidationError, match="needs `money`, `tokens`"):
        Policy.model_validate({"budgets": [{"period": "daily"}]})
    with pytest.raises(ValidationError, match="one budget per period"):
        Policy.model_validate({"budgets": [{"period": "daily", "tokens": 5}, {"period": "daily", "tokens": 6}]})
    with pytest.raises(ValidationError, match="without a price"):
        Policy.model_validate({"allowed_tiers": ["huge"]})
    with pytest.raises(ValidationError, match="decimal places"):
        Policy.model_validate({"prices": {"large": {"prompt": "0.123456", "completion": 1}}})
    p = Policy.model_validate({"allowed_tiers": ["small"]})
    assert p.allows("small") and not p.allows("large")
    assert p.check_tiers(["large"]) == [(("allowed_tiers", 0), "no tier named 'small'; served: large")]
    assert Policy.model_validate_json(p.model_dump_json()) == p  # round-trips through its JSON


def test_pricing_is_exact_and_savings_add_up() -> None:
    policy = Policy()
    rng = random.Random(0)
    for _ in range(500):
        completion = rng.randrange(0, 4000)
        t = Tokens(
            prompt=(prompt := rng.randrange(1, 8000)),
            completion=completion,
            cached_prompt=rng.randrange(0, prompt + 1),
            draft_accepted=rng.randrange(0, completion + 1),
            policy_cut=rng.randrange(0, 100),
            verifier_cut=rng.randrange(0, 100),
        )
        for tier in ("small", "large"):
            c = charge(policy, tier, t)
            levers = c.saved_routing + c.saved_cache + c.saved_speculation + c.saved_policy + c.saved_verifier
            assert c.counterfactual - c.cost == levers  # exactly, in Decimal
            assert to_units(c.cost) == c.cost * UNITS and from_units(to_units(c.cost)) == c.cost
            assert c.cost <= worst_case(policy, tier, t.prompt, t.completion)
    plain = charge(policy, "large", Tokens(prompt=1_000_000, completion=1_000_000))
    assert (plain.cost, plain.saved) == (D("2.50"), D(0))  # $0.50 + $2.00 per million
    small = charge(policy, "small", Tokens(prompt=1_000_000, completion=1_000_000))
    assert (small.cost, small.saved_routing) == (D("0.50"), D("2.00"))
    hit = charge(policy, "large", Tokens(prompt=10, completion=10, cache_hit=True))
    assert hit.cost == 0 and hit.saved_cache == hit.counterfactual > 0
    with pytest.raises(ValueError, match="decimal places"):
        to_units(D("0.00000000001"))


def test_budget_windows() -> None:
    day = datetime(2028, 2, 17, tzinfo=UTC).date()
    assert period_window("daily", day) == ("2028-02-17", day, day)
    name, first, last = period_window("monthly", day)
    assert (name, first.day, last.day) == ("2028-02", 1, 29)
    assert period_window("monthly", datetime(2026, 12, 31).date())[2].isoformat() == "2026-12-31"


@pytest.fixture(params=["redis", "local"])
def counters(request: pytest.FixtureRequest) -> object:
    if request.param == "local":
        return LocalCounters()
    return RedisCounters(request.getfixturevalue("redis_server"), request.getfixturevalue("redis_namespace"))


def test_reservations_are_all_or_nothing_under_concurrency(counters: LocalCounters | RedisCounters) -> None:
    ns = getattr(counters, "namespace", "local")  # Redis keys stay under the test's namespace

    async def run() -> None:
        a, b, seeded = f"{ns}:a", f"{ns}:b", f"{ns}:seeded"
        limit = 1_000
        results = await asyncio.gather(
            *(counters.reserve(f"r{i}", [Item(a, 7, limit), Item(b, 3)]) for i in range(400))
        )
        granted = [r for r in results if r is None]
        assert len(granted) == limit // 7  # every reservation that fits, and not one more
        assert await counters.get(a) == 7 * len(granted) and await counters.get(b) == 3 * len(granted)
        refused = next(r for r in results if r is not None)
        assert refused.index == 0 and refused.current == 7 * len(granted)
        assert len(await counters.outstanding()) == len(granted)
        await counters.settle("r0", [(a, -7), (b, -1)])
        assert await counters.get(a) == 7 * (len(granted) - 1) and "r0" not in await counters.outstanding()
        with pytest.raises(Missing) as info:
            await counters.reserve("x", [Item(seeded, 1, 10, seeded=True), Item(a, 1)])
        assert info.value.keys == [seeded] and await counters.get(a) == 7 * (len(granted) - 1)  # nothing added
        await counters.seed(seeded, 9, 60)
        await counters.seed(seeded, 0, 60)  # only if absent
        assert await counters.reserve("y", [Item(seeded, 2, 10, seeded=True)]) is not None
        assert await counters.reserve("z", [Item(seeded, 1, 10, seeded=True)]) is None
        await counters.close()

    asyncio.run(run())


def test_a_reservation_sent_twice_counts_once(counters: LocalCounters | RedisCounters) -> None:
    """The Redis client resends a command whose connection broke, and the first send may have run."""
    ns = getattr(counters, "namespace", "local")

    async def run() -> None:
        key = f"{ns}:once"
        assert await counters.reserve("twice", [Item(key, 5, 100)]) is None
        assert await counters.reserve("twice", [Item(key, 5, 100)]) is None
        assert await counters.get(key) == 5 and list(await counters.outstanding()) == ["twice"]
        assert await counters.settle("twice", [(key, -2)]) and await counters.get(key) == 3
        assert not await counters.settle("twice", [(key, -2)]) and await counters.get(key) == 3  # settled once
        await counters.close()

    asyncio.run(run())


def _usage(who: object, rid: str, cost: str, tokens: tuple[int, int], tier: str = "small", **kw: object) -> UsageRecord:
    return UsageRecord.from_columns(
        rid, who.tenant_id, who.key_id, "chat.completions", "m", tier, tokens[0], tokens[1], 5, "ok", "stop",
        cost=D(cost), counterfactual_cost=D(cost) * 3, saved_routing=D(cost) * 2, **kw,
    )  # fmt: skip


def test_ledger_rollup_and_reports_are_exact(database: Database, tmp_path: object) -> None:
    who = authenticate(database, create_tenant(database, "acme").key)
    other = authenticate(database, create_tenant(database, "other").key)
    ledger = Ledger(database, tmp_path / "spool.jsonl")  # type: ignore[operator]
    # a thousand tenths of a millionth of a cent: floats would drift, Decimal must not
    for i in range(1000):
        ledger.record(_usage(who, f"a{i}", "0.0000000001", (3, 4), tier="small" if i % 3 else "large"))
    ledger.record(_usage(other, "b0", "12.3456789012", (1, 1)))
    (acme,) = savings(database, [who.tenant_id])
    assert acme["cost"] == D("0.0000001") and acme["requests"] == 1000
    assert acme["counterfactual_cost"] == D("0.0000003") and acme["saved_routing"] == D("0.0000002")
    by_tier = costs(database, [who.tenant_id], group_by=("tier",))
    assert [(r["tier"], r["requests"], r["prompt_tokens"]) for r in by_tier] == [
        ("large", 334, 1002),
        ("small", 666, 1998),
    ]
    assert {r["tenant"] for r in costs(database, None)} == {"acme", "other"}
    before = costs(database, None, group_by=("day", "tier", "model"))
    assert rebuild_rollup(database) == 3  # the incremental rollup equals one recomputed from raw rows
    assert costs(database, None, group_by=("day", "tier", "model")) == before


def test_policy_versions_audit_rollback_and_cache(database: Database) -> None:
    who = authenticate(database, create_tenant(database, "acme").key)
    store = PolicyStore(database, ttl=60)
    assert store.current(who.tenant_id).version == 0
    v1 = store.save(who.tenant_id, Policy.model_validate({"sampling": {"max_tokens_cap": 64}}), "admin:x", "first")
    assert store.current(who.tenant_id).policy.sampling.max_tokens_cap == 64  # invalidated on change
    other = PolicyStore(database, ttl=60)
    assert other.current(who.tenant_id).version == 1
    store.save(who.tenant_id, Policy.model_validate({"sampling": {"max_tokens_cap": 8}}), "admin:y")
    assert other.current(who.tenant_id).version == 1  # another replica's cache: stale until its ttl
    other.ttl = 0
    assert other.current(who.tenant_id).version == 2
    v3 = store.rollback(who.tenant_id, v1, "admin:z")
    assert v3 == 3 and store.current(who.tenant_id).policy.sampling.max_tokens_cap == 64
    assert [v.version for v in store.history(who.tenant_id)] == [3, 2, 1]
    with pytest.raises(PolicyError):
        store.rollback(who.tenant_id, 42, "admin:z")
    from core.audit import entries

    log = [e for e in entries(database, who.tenant_id) if e.action.startswith("policy")]
    assert [(e.action, e.actor) for e in log] == [
        ("policy.rollback", "admin:z"),
        ("policy.update", "admin:y"),
        ("policy.update", "admin:x"),
    ]
    assert log[1].before["sampling"]["max_tokens_cap"] == 64 and log[1].after["sampling"]["max_tokens_cap"] == 8
    assert log[2].before["sampling"]["max_tokens_cap"] is None  # from the built-in default


def test_budget_counters_seed_from_sql_and_reconcile(
    database: Database, redis_server: str, redis_namespace: str, tmp_path: object
) -> None:
    who = authenticate(database, create_tenant(database, "acme").key)
    Ledger(database, tmp_path / "s.jsonl").record(_usage(who, "old", "0.75", (100, 50)))  # type: ignore[operator]
    policy = Policy.model_validate({"budgets": [{"period": "daily", "money": "1.00", "tokens": 1000}]})

    async def run() -> None:
        budgets = Budgets(database, RedisCounters(redis_server, redis_namespace), redis_namespace)
        # a fresh Redis knows nothing: the counter is loaded from the ledger before deciding
        with pytest.raises(Exception, match="daily budget of \\$1"):
            await budgets.admit("r1", policy, who.tenant_id, who.key_id, D("0.30"), 10)
        resv = await budgets.admit("r2", policy, who.tenant_id, who.key_id, D("0.20"), 10)
        assert await budgets.spent(who.tenant_id, "daily") == (D("0.95"), 160)
        with pytest.raises(Exception, match="1000 tokens"):
            await budgets.admit("r3", policy, who.tenant_id, who.key_id, D("0"), 841)
        # a lost counter (Redis restarted, or drifted): reconcile puts back SQL + what is in flight
        await budgets.counters.put(budgets.spend_key(who.tenant_id, "daily", resv_day(), "money"), 0, 60)
        assert await budgets.reconcile() == 4
        assert await budgets.spent(who.tenant_id, "daily") == (D("0.95"), 160)
        await budgets.settle(resv, D("0.05"), 7)
        assert await budgets.spent(who.tenant_id, "daily") == (D("0.80"), 157)
        await budgets.counters.close()

    asyncio.run(run())


def resv_day() -> str:
    return datetime.now(UTC).date().isoformat()


def test_dry_run_replays_a_new_policy_over_the_ledger(database: Database, tmp_path: object) -> None:
    from sqlalchemy import select

    from core.db.models import Usage

    who = authenticate(database, create_tenant(database, "acme").key)
    ledger = Ledger(database, tmp_path / "s.jsonl")  # type: ignore[operator]
    for i in range(6):
        tier = "large" if i % 2 else "small"
        cost = charge(Policy(), tier, Tokens(100, 40)).cost
        ledger.record(_usage(who, f"r{i}", str(cost), (100, 40), tier=tier, effective_max_tokens=64))
    with database.session() as s:
        rows = list(s.scalars(select(Usage)))
    new = Policy.model_validate(
        {
            "allowed_tiers": ["small"],
            "sampling": {"max_tokens_cap": 20},
            "budgets": [{"period": "daily", "tokens": 250}],
        }
    )
    result = replay(new, rows)
    assert result.requests == 6 and result.refused == {"tier": 3, "budget": 1} and result.clamped == 2
    assert result.cost_after == 2 * charge(new, "small", Tokens(100, 20)).cost
    assert result.cost_before == 3 * (
        charge(Policy(), "small", Tokens(100, 40)).cost + charge(Policy(), "large", Tokens(100, 40)).cost
    )
    assert replay(Policy(), rows).changes == []  # the policy they ran under changes nothing


def test_budgets_fail_closed_only_where_a_limit_is_at_stake(database: Database) -> None:
    """Redis down: a tenant with a hard budget or a rate limit gets 503s; one without is served
    uncounted (its ledger rows are the truth, and the counters are rebuilt when Redis is back)."""
    from gateway.http.errors import from_budget
    from policies.budgets import CountersUnavailable

    who = authenticate(database, create_tenant(database, "acme").key)
    port = __import__("services").free_port()  # nothing listens there

    async def run() -> None:
        budgets = Budgets(database, RedisCounters(f"redis://127.0.0.1:{port}/0"), "down")
        limited = Policy.model_validate({"budgets": [{"period": "daily", "money": "5"}]})
        for policy in (limited, Policy.model_validate({"rate_limits": {"key_rpm": 100}})):
            with pytest.raises(CountersUnavailable) as info:
                await budgets.admit("r", policy, who.tenant_id, who.key_id, D("0.01"), 10)
            refusal = from_budget(info.value)  # the one mapping to the OpenAI error shape
            assert refusal.status == 503 and refusal.code == "budget_unavailable"
        free = await budgets.admit("r", Policy(), who.tenant_id, who.key_id, D("0.01"), 10)
        assert free.items == []
        await budgets.settle(free, D("0.01"), 10)
        # settling after the fact never fails the request: the ledger row is the truth
        from policies.budgets import Reservation

        await budgets.settle(Reservation("r", [Item("down:x", 1)], 1, 1), D("0.01"), 10)
        await budgets.counters.close()

    asyncio.run(run())
