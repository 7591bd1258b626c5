"""Exploration: a share of the routed requests the large tier served is also run on the cheaper tiers the tenant
allows, and each cheaper answer judged against large's. Shadow runs (`gateway.routing.shadow`) ask whether what
a cheaper tier served was good enough; exploring asks whether what large served needed large. Together they are
the verdicts a tenant's own routing layer learns from (`gateway.routing.learning`).

    share     `router.explore_share` (default 0.05) of large-served, freshly generated routed chat answers; at
              least half (`WARMUP_SHARE`) until the tenant has `router.explore_warmup` (50) explore verdicts for
              the current tiers and router (runs under way included); 0 turns it off, as does the operator's
              `shadow_runs = false`
    run       once the response is out, behind live requests (the shadow priority), greedily on each cheaper
              tier (under the tenant's adapter where its policy serves the tier under one: what that tenant's
              tier is); judged against the large answer as shadow runs are (identical: yes; a word problem: its
              final number; else the large tier's judge)
    accounted one ledger row per tier run and one for its judge (`route = "explore"`, ids the request's plus
              `-explore-<tier>` and `-explore-<tier>-judge`): with `router.shadow_billed` priced at each
              engine's tier (a counterfactual of 0) against a reservation of the worst case; without it (the
              default) the operator pays and the rows carry zero tokens and money. The label row (`direction:
              "explore"`, `judged_tier`) keeps the run's tokens and its cost at the tenant's prices
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from decimal import Decimal

import anyio

from engines.protocol import RequestRejected
from gateway.routing.background import BackgroundRuns
from gateway.routing.learning import identities_for
from gateway.routing.shadow import JUDGE_TEMPLATE_TOKENS, WARMUP_SHARE, Relabeler
from gateway.routing.shadow_rows import Answer, Failed, ShadowJob, ShadowUsage, Spent, adapted, run_cost
from policies.budgets import BudgetError, Reservation
from policies.pricing import Tokens, worst_case
from policies.store import Versioned
from router_model.label import JUDGE_MAX_TOKENS, MAX_TOKENS, tier_model
from router_model.label_store import Row
from router_model.model import LARGE, SMALL

__all__ = ["Explorer"]

log = logging.getLogger(__name__)


class Explorer:
    def __init__(self, relabeler: Relabeler, rng: random.Random | None = None) -> None:
        self.relabeler = relabeler
        self._rng = rng or random.Random()
        self.runs = BackgroundRuns()
        # tier → model@weights/dtype, as the label rows record it: what verdicts are keyed by
        self.identities = {tier: tier_model(t) for tier, t in relabeler.settings.tiers.items()}
        # (tenant id, tier, adapter name) → the engine's name for it, loaded (None: no longer registered): set by
        # the pipeline, which owns the tenants' adapters; without it a tier under an adapter is not explored
        self.adapter_key: Callable[[int, str, str], Awaitable[str | None]] | None = None

    def share(self, policy: Versioned, tenant: str, router: str) -> float:
        """The share of the tenant's large answers explored now: the policy's, or WARMUP_SHARE until it has
        `explore_warmup` explore verdicts (runs under way included) for the current tiers and router."""
        settings = policy.policy.router
        if settings.explore_share <= 0:
            return 0.0
        identities = identities_for(self.identities, policy.policy)
        since = settings.learn_since
        done = self.relabeler.learning.count(tenant, identities, router, since=since, direction="explore")
        warm = done + self.runs.running(tenant) < settings.explore_warmup
        return max(settings.explore_share, WARMUP_SHARE) if warm else settings.explore_share

    def wants(self, policy: Versioned, served_by: str, tenant: str, router: str, tiers: list[str]) -> bool:
        """Whether this large-served answer is explored on `tiers` (the cheaper ones the tenant may use)."""
        if served_by != LARGE or not tiers or not self.relabeler.settings.shadow_runs:
            return False
        engines = self.relabeler.engines
        if not all(t in engines and engines[t].alive for t in (*tiers, LARGE)):
            return False
        share = self.share(policy, tenant, router)
        return share > 0 and self._rng.random() < share

    def submit(self, job: ShadowJob) -> None:
        """Start the run in the background; the caller's response is already out."""
        self.runs.start(self.run(job), job.tenant, f"explore {job.request_id}")

    async def run(self, job: ShadowJob) -> list[Row]:
        """Each cheaper tier's run, judged, accounted and logged; the label rows written. Never raises."""
        rows = []
        for tier in job.explore:
            try:
                row = await self._explore(job, tier)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("explore run of %s on %s failed", job.request_id, tier)
                continue
            if row is not None:
                rows.append(row)
        return rows

    async def _explore(self, job: ShadowJob, tier: str) -> Row | None:
        relabeler = self.relabeler
        started, clock = time.time(), time.perf_counter()
        engine, large = relabeler.engines[tier], relabeler.engines[LARGE]
        rid = f"{job.request_id}-explore-{tier}"
        prompt = await anyio.to_thread.run_sync(engine.tokenizer.encode_chat, job.messages)
        max_tokens = max(1, min(job.max_tokens, MAX_TOKENS, engine.max_model_len - len(prompt)))
        try:
            engine.check(prompt, max_tokens)
        except RequestRejected:
            return None  # too long for the cheaper tier: it could not have served it
        adapter, key = job.policy.policy.adapters.get(tier), None
        if adapter is not None:  # the tenant's tier is its adapter: judge that, or nothing
            key = await self.adapter_key(job.tenant_id, tier, adapter) if self.adapter_key is not None else None
            if key is None:
                return None
        reservation = None
        if job.policy.policy.router.shadow_billed:
            reservation = await self._reserve(job, rid, tier, len(prompt), max_tokens)
            if reservation is None:
                return None
        answer, spent, status, good, verdict = Answer(), Spent(), "ok", False, None
        try:
            try:  # generate runs at the shadow priority: behind live requests
                answer = await relabeler.generate(engine, rid, prompt, max_tokens, job.tenant_id, adapter=key)
            except Failed as failed:
                answer = failed.answer
                raise
            good, verdict = await relabeler.judge(large, f"{rid}-judge", job, job.answer_text, answer.text, spent)
        except Failed:
            status = "error"
        except asyncio.CancelledError:
            status = "aborted"
            raise
        finally:
            with anyio.CancelScope(shield=True):
                seconds = time.perf_counter() - clock
                runs = [self._usage(job, rid, tier, answer, max_tokens, status, seconds)]
                if spent.judge.prompt_tokens:  # a judge ran (not for identical answers or a word problem's numbers)
                    runs.append(self._usage(job, f"{rid}-judge", LARGE, spent.judge, JUDGE_MAX_TOKENS, status, seconds))
                await relabeler.meter.bill_all(runs, reservation)
        if status != "ok":
            return None
        cost = sum((run_cost(r) for r in runs), Decimal(0))
        row = self._row(job, tier, len(prompt), answer, spent.judge, good, verdict, seconds, started, cost)
        await anyio.to_thread.run_sync(relabeler.append, row)
        if relabeler.on_verdict is not None:
            await relabeler.on_verdict(job.tenant_id, job.tenant)
        return row

    async def _reserve(self, job: ShadowJob, rid: str, tier: str, prompt: int, max_tokens: int) -> Reservation | None:
        """A billed run's worst case (the tier's answer, large's judgement), reserved like a request's; None if
        the budgets refused."""
        policy = job.policy.policy
        judge_prompt = prompt + max_tokens + job.answer_tokens + JUDGE_TEMPLATE_TOKENS
        money = worst_case(policy, tier, prompt, max_tokens) + worst_case(policy, LARGE, judge_prompt, JUDGE_MAX_TOKENS)
        tokens = prompt + max_tokens + judge_prompt + JUDGE_MAX_TOKENS
        try:
            return await self.relabeler.budgets.admit(rid, policy, job.tenant_id, job.key_id, money, tokens)
        except BudgetError as exc:
            log.info("explore run for %s skipped: %s", job.request_id, type(exc).__name__)
            return None

    def _usage(
        self, job: ShadowJob, rid: str, tier: str, ran: Answer, max_tokens: int, status: str, seconds: float
    ) -> ShadowUsage:
        settings = self.relabeler.settings.tiers.get(tier)
        return ShadowUsage(
            request_id=rid, endpoint=job.endpoint, tenant_id=job.tenant_id, key_id=job.key_id, policy=job.policy,
            tier=tier, model=settings.model if settings else tier,
            tokens=Tokens(prompt=ran.prompt_tokens, completion=ran.tokens, cached_prompt=ran.cached),
            finish_reason=ran.finish, max_tokens=max_tokens, status=status, seconds=seconds,
            billed=job.policy.policy.router.shadow_billed, route="explore",
        )  # fmt: skip

    def _row(
        self, job: ShadowJob, tier: str, prompt: int, answer: Answer, judge: Answer, good: bool,
        verdict: str | None, seconds: float, started: float, cost: Decimal,
    ) -> Row:  # fmt: skip
        """The label row, in `router label`'s format for the explored tier, large's answer the reference."""
        tiers = self.relabeler.settings.tiers
        row: Row = {"id": f"live/{job.request_id}/{tier}", "source": "live", "direction": "explore",
                    "served": LARGE, "judged_tier": tier, f"{tier}_ok": good, "large_ok": True}  # fmt: skip
        if tier == SMALL:
            row["label"] = good
        row |= {
            "prompt_tokens": prompt, f"{tier}_tokens": answer.tokens, "large_tokens": job.answer_tokens,
            f"{tier}_finish": answer.finish, "large_finish": job.answer_finish, "seconds": round(seconds, 3),
            "judge": verdict, "judge_prompt_tokens": judge.prompt_tokens, "judge_tokens": judge.tokens,
            f"{tier}_model": adapted(tier_model(tiers[tier]) if tier in tiers else tier,
                                     job.policy.policy.adapters.get(tier)),
            "large_model": tier_model(tiers[LARGE]) if LARGE in tiers else LARGE,
            "request_id": job.request_id, "tenant_id": job.tenant_id, "tenant": job.tenant, "started": started,
            "cost_usd": str(cost), "cell": job.cell, "router": job.router,
        }  # fmt: skip
        if job.policy.policy.router.store_prompts:
            row["messages"] = job.messages
        return row

    async def close(self, timeout: float = 30.0) -> None:
        await self.runs.close(timeout)
