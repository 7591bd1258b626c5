"""`bench.ledger`'s first part: a bulk-loaded ledger (20 Zipf-sized tenants, synthetic usage rows over three
months, priced with the default policy) and its finance report timed from the daily rollup against a raw
GROUP BY over the usage rows."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import func, insert, select, text

from bench import timed
from bench.ledger_stats import ms, pct, say
from core.db.database import Database
from core.db.models import Tenant, Usage, UsageDaily
from gateway.accounting.ledger import AMOUNTS, COUNTS, rebuild_rollup
from gateway.accounting.reports import costs, savings
from gateway.accounting.tenants import authenticate, create_tenant
from policies.pricing import Tokens, charge
from policies.store import DEFAULT

TIER_MODELS = {
    "small": ("qwen2.5-coder-0.5b-instruct", "smollm2-360m-instruct"),
    "large": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-3b-instruct"),
}
TENANTS = 20
BATCH = 5000


def months_before(today: date, count: int) -> list[date]:
    """The first days of the `count` full months before today's month, oldest first."""
    firsts, d = [], today.replace(day=1)
    for _ in range(count):
        d = (d - timedelta(days=1)).replace(day=1)
        firsts.append(d)
    return firsts[::-1]


def month_end(first: date) -> date:
    return (first + timedelta(days=32)).replace(day=1) - timedelta(days=1)


# ---------------------------------------------------------------------------------------------------------
# 1. the finance report over a bulk-loaded ledger


def synthetic_rows(
    n: int, keys: list[tuple[int, int]], start: datetime, end: datetime, seed: int = 7
) -> Iterator[dict]:
    """Usage rows as `insert(Usage)` takes them, priced with the default policy."""
    rng = random.Random(seed)
    cum, total = [], 0.0
    for i in range(len(keys)):
        total += 1 / (i + 1)  # Zipf: the first tenant is the largest
        cum.append(total)
    span = (end - start).total_seconds()
    for i in range(n):
        tenant_id, key_id = rng.choices(keys, cum_weights=cum)[0]
        tier = "small" if rng.random() < 0.7 else "large"
        model = TIER_MODELS[tier][0] if rng.random() < 0.8 else TIER_MODELS[tier][1]
        prompt = min(16_000, max(1, int(rng.lognormvariate(6.0, 1.0))))
        completion = min(4096, max(1, int(rng.lognormvariate(5.0, 1.0))))
        cached = int(prompt * rng.random()) if rng.random() < 0.3 else 0
        accepted = int(completion * rng.uniform(0.3, 0.8)) if tier == "large" and rng.random() < 0.4 else 0
        cut = rng.randint(1, 512) if rng.random() < 0.05 else 0
        requested = rng.choice((None, 256, 512, 1024, 4096))
        roll = rng.random()
        status = "ok" if roll < 0.97 else "aborted" if roll < 0.99 else "error"
        finish = "length" if cut else {"ok": "stop", "aborted": "abort", "error": None}[status]
        price = charge(DEFAULT, tier, Tokens(prompt, completion, cached, accepted, cut))
        yield {
            "request_id": f"chatcmpl-bench{i:09d}",
            "tenant_id": tenant_id,
            "api_key_id": key_id,
            "endpoint": "chat.completions" if rng.random() < 0.9 else "completions",
            "model": model,
            "tier": tier,
            "prompt_tokens": prompt,
            "cached_prompt_tokens": cached,
            "completion_tokens": completion,
            "draft_proposed": accepted + rng.randint(0, accepted // 2 + 1) if accepted else 0,
            "draft_accepted": accepted,
            "requested_max_tokens": requested,
            "effective_max_tokens": requested or 4096,
            "cache_status": "miss",
            "route": "direct",
            "verifier_actions": [],
            "policy_version": 0,
            "cost": price.cost,
            "counterfactual_cost": price.counterfactual,
            "saved_cache": price.saved_cache,
            "saved_routing": price.saved_routing,
            "saved_speculation": price.saved_speculation,
            "saved_verifier": price.saved_verifier,
            "saved_policy": price.saved_policy,
            "latency_ms": 40 + prompt // 50 + completion * 20,
            "status": status,
            "finish_reason": finish,
            "created_at": start + timedelta(seconds=rng.random() * span),
        }


def load(db: Database, rows: int, start: datetime, end: datetime) -> tuple[list[int], float]:
    """Tenants with a key each, then the usage rows in batches; returns tenant ids (largest first), seconds."""
    keys: list[tuple[int, int]] = []
    for i in range(TENANTS):
        issued = create_tenant(db, f"bench-tenant-{i:02d}")
        principal = authenticate(db, issued.key)
        assert principal is not None
        keys.append((principal.tenant_id, principal.key_id))
    t0 = time.perf_counter()
    batch: list[dict] = []
    done = 0
    for row in synthetic_rows(rows, keys, start, end):
        batch.append(row)
        if len(batch) == BATCH:
            done += _insert(db, batch, done, rows, t0)
            batch = []
    if batch:
        done += _insert(db, batch, done, rows, t0)
    return [k[0] for k in keys], time.perf_counter() - t0


def _insert(db: Database, batch: list[dict], done: int, rows: int, t0: float) -> int:
    with db.session() as s:
        s.execute(insert(Usage), batch)
    done += len(batch)
    rate = done / (time.perf_counter() - t0)
    say(f"  inserted {done:>9,}/{rows:,} usage rows ({rate:,.0f} rows/s)")
    return len(batch)


def rollup_check(db: Database, tenant_id: int) -> tuple[bool, dict[str, Any]]:
    """The rollup's sums against the raw ledger's, for one tenant over all time."""
    names = (*COUNTS, *AMOUNTS)
    with db.session() as s:
        raw = s.execute(
            select(func.count(), *(func.sum(getattr(Usage, k)) for k in names)).where(Usage.tenant_id == tenant_id)
        ).one()
        rolled = s.execute(
            select(func.sum(UsageDaily.requests), *(func.sum(getattr(UsageDaily, k)) for k in names)).where(
                UsageDaily.tenant_id == tenant_id
            )
        ).one()
    same = int(raw[0]) == int(rolled[0])
    same = same and all(Decimal(a) == Decimal(b) for a, b in zip(raw[1:], rolled[1:], strict=True))
    return same, {"requests": int(raw[0]), "cost": Decimal(raw[1 + names.index("cost")])}


def report(db: Database, tenant_id: int, first: date, last: date) -> tuple[list[dict], list[dict]]:
    """The finance report, as the API serves it: from the daily rollup."""
    return costs(db, [tenant_id], first, last, ("day",)), savings(db, [tenant_id], first, last)


def raw_report(db: Database, tenant_id: int, first: date, last: date) -> tuple[list[dict], list[dict]]:
    """The same two answers by GROUP BY over the raw usage rows (the baseline the rollup replaces)."""
    start = datetime.combine(first, datetime.min.time(), UTC)
    end = datetime.combine(last + timedelta(days=1), datetime.min.time(), UTC)
    where = (Usage.tenant_id == tenant_id, Usage.created_at >= start, Usage.created_at < end)
    day = func.date(func.timezone("UTC", Usage.created_at)).label("day")
    keys = [Tenant.name.label("tenant"), day]
    sums = [func.count().label("requests"), *(func.sum(getattr(Usage, c)).label(c) for c in COUNTS)]
    sums += [func.sum(Usage.cost).label("cost"), func.sum(Usage.counterfactual_cost).label("counterfactual_cost")]
    by_day = select(*keys, *sums).join(Tenant, Tenant.id == Usage.tenant_id).where(*where)
    saved = [func.sum(getattr(Usage, k)).label(k) for k in AMOUNTS]
    total = select(Tenant.name.label("tenant"), func.count().label("requests"), *saved)
    total = total.join(Tenant, Tenant.id == Usage.tenant_id).where(*where).group_by(Tenant.name)
    with db.session() as s:
        rows = s.execute(by_day.group_by(*keys).order_by(*keys)).mappings().all()
    with db.session() as s:
        totals = s.execute(total).mappings().all()
    return [dict(r) for r in rows], [dict(r) for r in totals]


# ---------------------------------------------------------------------------------------------------------
# 2. the request path against a no-op engine


@dataclass
class ReportTiming:
    """Part 1's measurements."""

    months: list[date]
    load_s: float
    rollup_s: float
    rollup_rows: int
    tenant_id: int
    same: bool
    totals: dict[str, Any]
    first: date
    last: date
    month_rows: int
    days: int
    agree: bool
    t_roll: list[float]
    t_raw: list[float]


def finance_report(db: Database, rows: int, reps: int) -> ReportTiming:
    """Load `rows` synthetic usage rows, rebuild the rollup, check it, and time the report both ways."""
    months = months_before(datetime.now(UTC).date(), 3)
    start = datetime.combine(months[0], datetime.min.time(), UTC)
    end = datetime.combine(month_end(months[-1]) + timedelta(days=1), datetime.min.time(), UTC)
    say(f"loading {rows:,} usage rows for {TENANTS} tenants, {months[0]} to {month_end(months[-1])}")
    tenant_ids, load_s = load(db, rows, start, end)
    t0 = time.perf_counter()
    rollup_rows = rebuild_rollup(db)
    rollup_s = time.perf_counter() - t0
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE usage"))
        conn.execute(text("ANALYZE usage_daily"))
    tid = tenant_ids[0]
    same, totals = rollup_check(db, tid)
    first, last = months[1], month_end(months[1])
    with db.session() as s:
        month_rows = s.scalar(
            select(func.count()).where(
                Usage.tenant_id == tid,
                Usage.created_at >= datetime.combine(first, datetime.min.time(), UTC),
                Usage.created_at < datetime.combine(last + timedelta(days=1), datetime.min.time(), UTC),
            )
        )
    rolled, raw = report(db, tid, first, last), raw_report(db, tid, first, last)
    agree = sum(r["cost"] for r in rolled[0]) == sum(r["cost"] for r in raw[0]) and len(rolled[0]) == len(raw[0])
    say(f"timing the finance report ({reps} runs each)")
    t_roll = timed(lambda: report(db, tid, first, last), reps)
    t_raw = timed(lambda: raw_report(db, tid, first, last), reps)

    return ReportTiming(months, load_s, rollup_s, rollup_rows, tid, same, totals, first, last, month_rows or 0,
                        len(rolled[0]), agree, t_roll, t_raw)  # fmt: skip


def print_report(r: ReportTiming, rows: int) -> None:
    months, load_s, rollup_s, rollup_rows, tid, same, totals = (r.months, r.load_s, r.rollup_s, r.rollup_rows,
                                                                r.tenant_id, r.same, r.totals)  # fmt: skip
    first, last, month_rows, t_roll, t_raw, agree = r.first, r.last, r.month_rows, r.t_roll, r.t_raw, r.agree
    print(f"\n## Ledger: {rows:,} usage rows, {TENANTS} tenants, {months[0]} to {month_end(months[-1])}\n")
    print(f"bulk insert {load_s:.1f} s ({rows / load_s:,.0f} rows/s); rebuild_rollup {rollup_s:.2f} s")
    print(f"rollup: {rollup_rows:,} rows (tenant, day, tier, model)")
    check = "equal" if same else "DIFFERENT"
    print(f"rollup check, tenant {tid} (all time): {totals['requests']:,} requests, ${totals['cost']:.4f}: {check}")
    print(f"report: tenant {tid}, {first} to {last}: {month_rows:,} raw rows, {r.days} days")
    print(f"rollup and raw reports agree: {'yes' if agree else 'NO'}\n")
    print("| finance report (costs by day + savings) | median ms | p99 ms |")
    print("|---|---:|---:|")
    print(f"| daily rollup (reports.costs + savings) | {ms(statistics.median(t_roll))} | {ms(pct(t_roll, 99))} |")
    print(f"| raw GROUP BY over usage (baseline) | {ms(statistics.median(t_raw))} | {ms(pct(t_raw, 99))} |")
