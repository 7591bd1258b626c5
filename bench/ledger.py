"""The ledger at scale: finance-report latency over a bulk-loaded ledger, and the request-path overhead of
policy + budget + ledger against a no-op engine.

    .venv/bin/python -m bench.ledger [--rows 100000] [--requests 2000]

Needs the PostgreSQL and Redis the tests use (tests/services.py: the local servers, or throwaway ones
started from the installed binaries). No model runs and torch does no work, so no OMP_NUM_THREADS.

1. Finance report. A fresh PostgreSQL database gets 20 tenants (Zipf-sized) and --rows synthetic usage
   rows over the three full months before this one, across tiers and models, priced with the default
   policy (`policies.pricing.charge`), bulk-inserted; then `rebuild_rollup`, a check that the rollup
   equals the raw sums, and ANALYZE (what autovacuum would do soon after a load). Timed, --reps times:
   the finance report for the largest tenant and the middle month, `reports.costs` by day plus
   `reports.savings` (from the daily rollup), and, as the baseline, the same two answers computed by
   GROUP BY over the raw usage rows. `report_ms` is the rollup report's median.
2. Request path. The real `Pipeline` over a no-op engine (answers every request at once, STOP, with
   64 tokens), a tenant whose policy has daily and monthly hard budgets and key/tenant rate limits
   (all far from refusing), `RedisCounters` on Redis and the ledger on PostgreSQL; and again on SQLite
   with `LocalCounters`, for information. Each request is `start_chat` and then `events()` to the end,
   sequential in one asyncio loop, after a warm-up. Overhead per request = the policy lookup (the
   store's 1 s cache and any thread hop included) + `Budgets.admit` + everything after the engine's
   last output (`Meter.bill` in gateway/pipeline/metering.py: pricing, the ledger row and rollup upsert in their thread,
   `Budgets.settle`), timed around those stages; `overhead_p50_ms`/`overhead_p99_ms` are its
   percentiles on PostgreSQL + Redis. As a cross-check, the same requests run, interleaved, through a
   pipeline whose policy store, budgets and ledger are in-memory no-ops: the difference of the whole
   requests' medians (`overhead_diff_p50_ms`) is what the real stores add beyond the thread hops and
   the pricing that pipeline still does.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import anyio
from sqlalchemy import func, insert, select, text

from bench import from_tests, timed
from core.db.database import Database
from core.db.models import Tenant, Usage, UsageDaily
from core.settings import Settings, TierSettings
from engines.async_engine import AsyncEngine
from engines.protocol import RequestRejected
from engines.request import EngineRequest, FinishReason, RequestOutput
from gateway.accounting.ledger import AMOUNTS, COUNTS, Ledger, UsageRecord, rebuild_rollup
from gateway.accounting.reports import costs, savings
from gateway.accounting.tenants import Principal, authenticate, create_tenant
from gateway.http.schemas import ChatCompletionRequest
from gateway.pipeline import Pipeline
from policies.budgets import Budgets, Reservation
from policies.counters import LocalCounters, RedisCounters
from policies.policy import Budget, Policy, RateLimits
from policies.pricing import Tokens, charge
from policies.store import DEFAULT, PolicyStore, Versioned

TIER_MODELS = {
    "small": ("qwen2.5-coder-0.5b-instruct", "smollm2-360m-instruct"),
    "large": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-3b-instruct"),
}
TENANTS = 20
BATCH = 5000
COMPLETION = 64  # tokens the no-op engine "generates" per request


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


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


class NoopTokenizer:
    """What the pipeline reads of a `Tokenizer` on the chat path: no template (so tools would take the Hermes
    fallback) and ~4 characters a token."""

    chat_template: str | None = None

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return [1] * max(1, sum(len(str(m["content"])) for m in messages) // 4)


class NoopStream:
    """`RequestStream`'s surface: each request finishes (STOP) on its first output."""

    def __init__(self, requests: list[EngineRequest]) -> None:
        self.queue = list(requests)
        self.last: dict[str, RequestOutput] = {}

    def __aiter__(self) -> NoopStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.queue:
            raise StopAsyncIteration
        r = self.queue.pop(0)
        n = min(COMPLETION, r.params.max_tokens)
        out = RequestOutput(r.request_id, [0] * n, "x" * n, len(r.prompt_token_ids), n, FinishReason.STOP)
        self.last[r.request_id] = out
        return out

    async def aclose(self) -> None:
        self.queue.clear()


class NoopEngine:
    """What `Pipeline` uses of an `AsyncEngine`, answering at once."""

    def __init__(self, name: str, max_model_len: int = 8192) -> None:
        self.name = name
        self.alive = True
        self.tokenizer = NoopTokenizer()
        self.max_model_len = max_model_len

    def check(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        if len(prompt_token_ids) + max_tokens > self.max_model_len:
            raise RequestRejected("too long", code="context_length_exceeded")

    def open(self, requests: list[EngineRequest]) -> NoopStream:
        return NoopStream(requests)


@dataclass
class Stages:
    """Per request, seconds in each stage, filled by the timed stand-ins below (requests run one at a time)."""

    current: dict[str, float] = field(default_factory=dict)
    done: list[dict[str, float]] = field(default_factory=list)

    def add(self, stage: str, seconds: float) -> None:
        self.current[stage] = self.current.get(stage, 0.0) + seconds

    def finish(self, keep: bool) -> None:
        if keep:
            self.done.append(self.current)
        self.current = {}

    def series(self, stage: str) -> list[float]:
        return [d.get(stage, 0.0) for d in self.done]


class TimedPipeline(Pipeline):
    stages: Stages

    async def policy(self, principal: Principal) -> Versioned:
        t0 = time.perf_counter()
        try:
            return await super().policy(principal)
        finally:
            self.stages.add("policy", time.perf_counter() - t0)


class TimedBudgets(Budgets):
    stages: Stages

    async def admit(self, *args: Any, **kwargs: Any) -> Reservation:
        t0 = time.perf_counter()
        try:
            return await super().admit(*args, **kwargs)
        finally:
            self.stages.add("admit", time.perf_counter() - t0)

    async def settle(self, resv: Reservation, cost: Decimal, tokens: int) -> None:
        t0 = time.perf_counter()
        try:
            await super().settle(resv, cost, tokens)
        finally:
            self.stages.add("settle", time.perf_counter() - t0)


class TimedLedger(Ledger):
    stages: Stages

    def _commit(self, recs: list[UsageRecord]) -> list[BaseException | None]:
        """The transaction in the writer's thread (`write` hops there); requests run one at a time, so
        each batch is one request's row."""
        t0 = time.perf_counter()
        try:
            return super()._commit(recs)
        finally:
            self.stages.add("ledger_write", time.perf_counter() - t0)


class NoPolicies:
    def __init__(self, versioned: Versioned) -> None:
        self.versioned = versioned

    def current(self, tenant_id: int) -> Versioned:
        return self.versioned

    def cached(self, tenant_id: int) -> Versioned | None:
        return self.versioned


class NoBudgets:
    async def admit(self, resv_id: str, *args: Any, **kwargs: Any) -> Reservation:
        return Reservation(resv_id, [], 0, 0)

    async def settle(self, resv: Reservation, cost: Decimal, tokens: int) -> None:
        return None


class NoLedger:
    async def write(self, rec: UsageRecord) -> None:
        await anyio.to_thread.run_sync(self.record, rec)  # the real ledger's hop to its writer thread

    def record(self, rec: UsageRecord) -> None:
        return None


def bench_policy() -> Policy:
    """Hard daily and monthly budgets and rate limits on every counter, all far from refusing."""
    return Policy(
        budgets=[
            Budget(period="daily", money=Decimal(100_000), tokens=10**12),
            Budget(period="monthly", money=Decimal(1_000_000), tokens=10**13),
        ],
        rate_limits=RateLimits(key_rpm=10**6, key_tpm=10**10, tenant_rpm=10**6, tenant_tpm=10**10),
    )


def settings(home: Path, url: str) -> Settings:
    tiers = {tier: TierSettings(model=models[0]) for tier, models in TIER_MODELS.items()}
    return Settings(home=home, database_url=url, tiers=tiers, auto_fetch=False, auto_migrate=False)


def engines() -> Mapping[str, AsyncEngine]:
    return {tier: cast(AsyncEngine, NoopEngine(tier)) for tier in TIER_MODELS}


async def live_pipeline(
    db: Database, counters: RedisCounters | LocalCounters, ns: str, home: Path
) -> tuple[TimedPipeline, Stages, Principal]:
    """The real pipeline, its stages, and the principal of a tenant with the bench policy."""
    issued = create_tenant(db, f"bench-live-{uuid.uuid4().hex[:6]}")
    principal = authenticate(db, issued.key)
    assert principal is not None
    store = PolicyStore(db)
    store.save(principal.tenant_id, bench_policy(), "bench", note="bench/ledger.py")
    stages = Stages()
    budgets = TimedBudgets(db, counters, ns)
    ledger = TimedLedger(db, home / "usage-spool.jsonl")
    pipeline = TimedPipeline(engines(), ledger, settings(home, db.url), store, budgets)
    for part in (budgets, ledger, pipeline):
        part.stages = stages
    return pipeline, stages, principal


def chat(i: int) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="small" if i % 2 else "large",
        messages=[
            {"role": "system", "content": "You are a careful assistant. " * 8},
            {"role": "user", "content": f"Question {i}: explain the request pipeline in detail. " * 20},
        ],
        max_tokens=256,
    )


async def one_request(pipeline: Pipeline, principal: Principal, body: ChatCompletionRequest) -> dict[str, float]:
    """start_chat, then events() to the end; the seconds of the whole, of start, and after the last output."""
    t0 = time.perf_counter()
    gen = await pipeline.start_chat(principal, body)
    t1 = last = time.perf_counter()
    async with aclosing(gen.events()) as events:
        async for _ in events:
            last = time.perf_counter()
    t3 = time.perf_counter()
    return {"total": t3 - t0, "start": t1 - t0, "finish": t3 - last}


async def request_path(pg: Database, sq: Database, redis_url: str, home: Path, n: int, warmup: int) -> dict:
    ns = f"sbbench-{uuid.uuid4().hex[:8]}"
    redis = RedisCounters(redis_url, ns)
    local = LocalCounters()
    runs: dict[str, tuple[Pipeline, Stages | None, Principal]] = {}
    try:
        runs["postgresql+redis"] = await live_pipeline(pg, redis, ns, home / "pg")
        runs["sqlite+local"] = await live_pipeline(sq, local, "sb", home / "sqlite")
        _, _, principal = runs["postgresql+redis"]
        versioned = await runs["postgresql+redis"][0].policy(principal)
        stub = Pipeline(
            engines(),
            cast(Ledger, NoLedger()),
            settings(home / "stub", "sqlite://"),
            cast(PolicyStore, NoPolicies(versioned)),
            cast(Budgets, NoBudgets()),
        )
        runs["no-op stand-ins"] = (stub, None, principal)
        whole: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
        say(f"request path: {warmup} warm-up + {n} requests per pipeline, interleaved")
        for i in range(warmup + n):
            body = chat(i)
            for name, (pipeline, stages, principal) in runs.items():
                timing = await one_request(pipeline, principal, body)
                if stages is not None:
                    stages.add("finish", timing["finish"])
                    stages.finish(keep=i >= warmup)
                if i >= warmup:
                    whole[name].append(timing)
            if (i + 1) % 500 == 0:
                say(f"  {i + 1}/{warmup + n} requests")
        return {"whole": whole, "stages": {name: run[1] for name, run in runs.items() if run[1] is not None}}
    finally:
        for pipeline, stages, _ in runs.values():
            if stages is not None:  # the real ledgers: stop their writer tasks
                await pipeline.ledger.aclose()
        keys = [k async for k in redis.redis.scan_iter(f"{ns}:*")]
        if keys:
            await redis.redis.delete(*keys)
        await redis.close()


# ---------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ledger", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000, help="synthetic usage rows")
    ap.add_argument("--reps", type=int, default=50, help="timed runs of each report")
    ap.add_argument("--requests", type=int, default=2000, help="timed requests per pipeline")
    ap.add_argument("--warmup", type=int, default=200, help="untimed requests per pipeline first")
    args = ap.parse_args()

    svc = from_tests("services")  # the PostgreSQL and Redis the test suite uses
    url, drop = svc.create_database(svc.postgres_url())
    redis_url = svc.redis_url()
    db = Database(url)
    tmp = tempfile.TemporaryDirectory(prefix="sb-bench-ledger-")
    sq = Database(f"sqlite:///{tmp.name}/bench.db")
    try:
        db.upgrade()
        sq.upgrade()
        months = months_before(datetime.now(UTC).date(), 3)
        start = datetime.combine(months[0], datetime.min.time(), UTC)
        end = datetime.combine(month_end(months[-1]) + timedelta(days=1), datetime.min.time(), UTC)
        say(f"loading {args.rows:,} usage rows for {TENANTS} tenants, {months[0]} to {month_end(months[-1])}")
        tenant_ids, load_s = load(db, args.rows, start, end)
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
        say(f"timing the finance report ({args.reps} runs each)")
        t_roll = timed(lambda: report(db, tid, first, last), args.reps)
        t_raw = timed(lambda: raw_report(db, tid, first, last), args.reps)

        home = Path(tmp.name)
        paths = asyncio.run(request_path(db, sq, redis_url, home, args.requests, args.warmup))
    finally:
        db.dispose()
        sq.dispose()
        drop()
        tmp.cleanup()
        svc.stop_all()  # throwaway servers started for this run, if any

    print(f"\n## Ledger: {args.rows:,} usage rows, {TENANTS} tenants, {months[0]} to {month_end(months[-1])}\n")
    print(f"bulk insert {load_s:.1f} s ({args.rows / load_s:,.0f} rows/s); rebuild_rollup {rollup_s:.2f} s")
    print(f"rollup: {rollup_rows:,} rows (tenant, day, tier, model)")
    check = "equal" if same else "DIFFERENT"
    print(f"rollup check, tenant {tid} (all time): {totals['requests']:,} requests, ${totals['cost']:.4f}: {check}")
    print(f"report: tenant {tid}, {first} to {last}: {month_rows:,} raw rows, {len(rolled[0])} days")
    print(f"rollup and raw reports agree: {'yes' if agree else 'NO'}\n")
    print("| finance report (costs by day + savings) | median ms | p99 ms |")
    print("|---|---:|---:|")
    print(f"| daily rollup (reports.costs + savings) | {ms(statistics.median(t_roll))} | {ms(pct(t_roll, 99))} |")
    print(f"| raw GROUP BY over usage (baseline) | {ms(statistics.median(t_raw))} | {ms(pct(t_raw, 99))} |")

    print(f"\n## Request path, no-op engine: {args.requests} requests per pipeline after {args.warmup} warm-up\n")
    print("| pipeline | request p50 ms | request p99 ms | overhead p50 ms | overhead p99 ms | overhead mean ms |")
    print("|---|---:|---:|---:|---:|---:|")
    summary: dict[str, dict[str, float]] = {}
    for name, timings in paths["whole"].items():
        total = [t["total"] for t in timings]
        row = {"p50": ms(statistics.median(total)), "p99": ms(pct(total, 99))}
        stages: Stages | None = paths["stages"].get(name)
        cells = ["-", "-", "-"]
        if stages is not None:
            over = [d.get("policy", 0) + d.get("admit", 0) + d["finish"] for d in stages.done]
            row |= {"over_p50": ms(statistics.median(over)), "over_p99": ms(pct(over, 99))}
            row["over_mean"] = ms(statistics.mean(over))
            cells = [str(row["over_p50"]), str(row["over_p99"]), str(row["over_mean"])]
        summary[name] = row
        print(f"| {name} | {row['p50']} | {row['p99']} | {' | '.join(cells)} |")
    print("\n| stage (p50 / p99 ms) | " + " | ".join(paths["stages"]) + " |")
    print("|---|" + "---:|" * len(paths["stages"]))
    labels = {
        "policy": "policy lookup (PolicyStore)",
        "admit": "Budgets.admit",
        "finish": "after last output (_account)",
        "ledger_write": "  of it: ledger row + rollup (in thread)",
        "settle": "  of it: Budgets.settle",
    }
    for stage, label in labels.items():
        cells = []
        for stages in paths["stages"].values():
            series = stages.series(stage)
            cells.append(f"{ms(statistics.median(series))} / {ms(pct(series, 99))}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    live, stub = summary["postgresql+redis"], summary["no-op stand-ins"]
    diff = round(live["p50"] - stub["p50"], 3)
    sqlite_diff = round(summary["sqlite+local"]["p50"] - stub["p50"], 3)
    print(
        f"\nwhole-request p50 minus the no-op stand-ins' ({stub['p50']} ms): postgresql+redis {diff} ms, "
        f"sqlite+local {sqlite_diff} ms\n(the stand-in pipeline still prices and hops threads to its no-op ledger)"
    )

    result = {
        "rows": args.rows,
        "backend": "postgresql+redis",
        "report_ms": ms(statistics.median(t_roll)),
        "report_p99_ms": ms(pct(t_roll, 99)),
        "report_raw_ms": ms(statistics.median(t_raw)),
        "report_raw_p99_ms": ms(pct(t_raw, 99)),
        "report_month_rows": month_rows,
        "rollup_check": same,
        "overhead_p50_ms": live["over_p50"],
        "overhead_p99_ms": live["over_p99"],
        "overhead_mean_ms": live["over_mean"],
        "overhead_diff_p50_ms": diff,
        "request_p50_ms": live["p50"],
        "stub_request_p50_ms": stub["p50"],
        "sqlite_overhead_p50_ms": summary["sqlite+local"]["over_p50"],
        "sqlite_overhead_p99_ms": summary["sqlite+local"]["over_p99"],
        "requests": args.requests,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
