"""`bench.ledger`'s second part: the request-path overhead of policy + budget + ledger, through the real
`Pipeline` over a no-op engine, on PostgreSQL + Redis and on SQLite, against a pipeline whose stores are
in-memory no-ops."""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import anyio

from bench.ledger_rows import TIER_MODELS
from bench.ledger_stats import ms, pct, say
from core.db.database import Database
from core.settings import Settings, TierSettings
from engines.async_engine import AsyncEngine
from engines.protocol import RequestRejected
from engines.request import EngineRequest, FinishReason, RequestOutput
from gateway.accounting.ledger import Ledger, UsageRecord
from gateway.accounting.tenants import Principal, authenticate, create_tenant
from gateway.http.schemas import ChatCompletionRequest
from gateway.pipeline import Pipeline
from policies.budgets import Budgets, Reservation
from policies.counters import LocalCounters, RedisCounters
from policies.policy import Budget, Policy, RateLimits
from policies.store import PolicyStore, Versioned

COMPLETION = 64  # tokens the no-op engine "generates" per request


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


def print_paths(paths: dict, requests: int, warmup: int) -> dict[str, dict[str, float]]:
    """The request-path tables; each pipeline's request and overhead percentiles."""
    print(f"\n## Request path, no-op engine: {requests} requests per pipeline after {warmup} warm-up\n")
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
    return summary
