"""Online relabeling: a share of live tiny- and small-tier answers re-run on the large tier, judged, and
logged as label rows: the tenant's quality estimate (`gateway.routing.quality_floor`) and, with the
conversation, what `switchboard router train --from-logs` learns from.

After a routed request's response has gone out (never on its path), the routing stage hands it here
if the tenant's policy asks (`router.shadow_share`, default 0.05) and the operator runs shadow runs
(`shadow_runs`, default on). The conversation runs greedily on the large tier, behind live requests (a
lower engine priority), and the large tier judges the cheaper tier's answer against its own with
`router_model.label`'s judge: live traffic has no reference answers, so every live prompt is graded
the way `router label` grades open chat (identical answers need no judge). The row keeps the
conversation only where the policy says `router.store_prompts`: without it, it is a verdict (for the
estimate) that trains nothing.

Accounting, one ledger row per shadow run (`route = "shadow"`, its id the request's plus `-shadow`):
- `router.shadow_billed: true`: the run is the tenant's like any request: its worst case (answer and
  judge) is reserved against the tenant's budgets and rate limits first (refused: no run, no row), it
  is priced at the large tier's prices (`policies.pricing.charge_shadow`: counterfactual 0, the price
  a negative routing saving) and settled.
- false (the default): the operator pays for relabeling. The row records the run (tier, model,
  latency, status) with zero tokens and zero money, since the ledger's tokens and money are what the
  tenant's budgets are rebuilt from and what finance bills; the run's real token counts are in its
  label row (`prompt_tokens`, `large_tokens`, `judge_prompt_tokens`, `judge_tokens`).

The label log is JSONL under the home directory, one row per judged run in `router label`'s format
(`<served>_ok`, `<served>_tokens`, ... for the tier that served) plus `served`, `request_id`,
`tenant_id`, `tenant` (its name), `started` (epoch seconds when the shadow run began) and, with
`store_prompts`, `messages`. Each verdict also counts toward its tenant's quality estimate
(`router_model.quality`, in `GET /v1/admin/router`) and is handed to `on_verdict` (the routing stage's
recalibration check); the counts are read back from the log at start.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping

import anyio

from core.settings import Settings
from engines.protocol import EngineUnavailable, RequestRejected, TierEngine
from engines.request import EngineRequest, FinishReason
from engines.sampling import SamplingParams
from gateway.accounting.ledger import Ledger
from gateway.accounting.metrics import Metrics
from gateway.http.errors import from_budget
from gateway.routing.background import BackgroundRuns
from gateway.routing.quality_floor import estimate_since
from gateway.routing.shadow_rows import (
    Answer,
    Failed,
    ShadowJob,
    ShadowMeter,
    Spent,
    label_row,
    labels_path,
    run_cost,
    shadow_usage,
)
from grading.examples import passes_prompt_examples
from grading.graders import judge_messages, number_agreement, parse_verdict
from policies.budgets import BudgetError, Budgets, Reservation
from policies.pricing import worst_case
from policies.store import Versioned
from router_model.features import split_conversation
from router_model.label import JUDGE_MAX_TOKENS, MAX_TOKENS
from router_model.label_store import Row, open_appender, read_rows
from router_model.model import LARGE, SMALL, TINY
from router_model.quality import TenantVerdicts
from router_model.tenant_layer import LearningVerdicts, verdict_of

log = logging.getLogger(__name__)

SHADOW_PRIORITY = 1  # live requests run at 0: a shadow run waits behind them
# A new tenant's first verdicts are drawn at half its cheaper answers or more: at 5% an 800-request day gave
# 2-7 verdicts a tenant (docs/savings.md), an interval 0.3-0.6 wide. With 50 (`shadow_warmup`) the 95%
# interval is ±0.043 where half the answers are small-served and 90% good enough, ±0.066 split over small
# and tiny (router_model.quality.estimate; ±0.068 / ±0.105 at 20). At this share they take ~100 cheaper
# answers, and cost the operator 50 large runs and judges once per tenant and recalibration.
WARMUP_SHARE = 0.5
JUDGE_TEMPLATE_TOKENS = 256  # the judge prompt's own words, over the question and both answers (a bound)


class Relabeler:
    def __init__(
        self,
        engines: Mapping[str, TierEngine],
        settings: Settings,
        ledger: Ledger,
        budgets: Budgets,
        metrics: Metrics | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.engines = engines
        self.settings = settings
        self.budgets = budgets
        self.meter = ShadowMeter(ledger, budgets, metrics)
        self.path = labels_path(settings.home_dir)
        self._rng = rng or random.Random()
        self._append_lock = threading.Lock()  # rows from concurrent runs never interleave
        self.runs = BackgroundRuns()
        self.verdicts = TenantVerdicts()  # per tenant: the shadow verdicts so far, the log's included
        self.learning = LearningVerdicts()  # per tenant: shadow and explore verdicts by cell, for its layer
        self.on_verdict: Callable[[int, str], Awaitable[object]] | None = None  # (tenant id, name) after each row
        try:
            rows = read_rows(self.path)
            self.verdicts.load(rows)
            self.learning.load(rows)
        except ValueError as exc:  # a damaged log: the estimates start over rather than the gateway failing
            log.warning("tenant quality estimates start empty: %s", exc)

    def share(self, policy: Versioned, tenant: str) -> float:
        """The share of the tenant's cheaper answers drawn now: the policy's, or WARMUP_SHARE while the tenant
        has fewer than `shadow_warmup` verdicts (runs under way included) since its last recalibration."""
        router = policy.policy.router
        if router.shadow_share <= 0:  # the tenant turned the estimate off: no warm-up either
            return 0.0
        fresh = max(0, self.verdicts.judged(tenant) - estimate_since(router)) + self.runs.running(tenant)
        return max(router.shadow_share, WARMUP_SHARE) if fresh < router.shadow_warmup else router.shadow_share

    def wants(self, policy: Versioned, served_by: str, tenant: str) -> bool:
        """Whether this tiny- or small-tier answer is drawn for a shadow run (`share`; shadow runs on; a large
        tier to run on)."""
        share = self.share(policy, tenant)
        large = self.engines.get(LARGE)
        if served_by not in (TINY, SMALL) or share <= 0 or not self.settings.shadow_runs:
            return False
        return large is not None and large.alive and self._rng.random() < share

    def submit(self, job: ShadowJob) -> None:
        """Start the run in the background; the caller's response is already out."""
        self.runs.start(self.run(job), job.tenant, f"shadow {job.request_id}")

    async def run(self, job: ShadowJob) -> Row | None:
        """Run, judge, account and log one shadow run; the label row, or None if there is none. Never raises."""
        try:
            return await self._run(job)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("shadow run for %s failed", job.request_id)
            return None

    async def _run(self, job: ShadowJob) -> Row | None:
        started, clock = time.time(), time.perf_counter()
        engine = self.engines[LARGE]
        rid = f"{job.request_id}-shadow"
        prompt = await anyio.to_thread.run_sync(engine.tokenizer.encode_chat, job.messages)
        max_tokens = max(1, min(job.max_tokens, MAX_TOKENS, engine.max_model_len - len(prompt)))
        try:
            engine.check(prompt, max_tokens)
        except RequestRejected:
            return None  # too long for the large tier: nothing to compare with
        billed = job.policy.policy.router.shadow_billed
        reservation = None
        if billed:
            reservation = await self._reserve(job, rid, len(prompt), max_tokens)
            if reservation is None:
                return None
        spent, status = Spent(), "ok"
        good_enough, verdict = False, None
        try:
            good_enough, verdict = await self._compare(engine, rid, prompt, max_tokens, job, spent)
        except Failed:
            status = "error"
        except asyncio.CancelledError:
            status = "aborted"
            raise
        except Exception:
            status = "error"
            raise
        finally:
            with anyio.CancelScope(shield=True):  # what ran is written down, however the run ended
                usage = shadow_usage(job, rid, spent, self.settings, max_tokens, status, time.perf_counter() - clock)
                await self.meter.bill(usage, reservation)
        if status != "ok":
            return None
        seconds = time.perf_counter() - clock
        row = label_row(job, len(prompt), spent, good_enough, verdict, seconds, started, self.settings.tiers,
                        run_cost(usage))  # fmt: skip
        await anyio.to_thread.run_sync(self.append, row)
        if self.on_verdict is not None:
            await self.on_verdict(job.tenant_id, job.tenant)
        return row

    async def _reserve(self, job: ShadowJob, rid: str, prompt: int, max_tokens: int) -> Reservation | None:
        """A billed run's worst case (answer and judge), reserved like a request's; None if refused."""
        policy = job.policy.policy
        judge_prompt = prompt + max_tokens + job.answer_tokens + JUDGE_TEMPLATE_TOKENS
        completion = max_tokens + JUDGE_MAX_TOKENS
        money = worst_case(policy, LARGE, prompt + judge_prompt, completion)
        try:
            return await self.budgets.admit(
                rid, policy, job.tenant_id, job.key_id, money, prompt + judge_prompt + completion
            )
        except BudgetError as exc:  # over budget, rate-limited, counters down: relabeling waits for another request
            log.info("shadow run for %s skipped: %s", job.request_id, from_budget(exc).code)
            return None

    async def _compare(
        self, engine: TierEngine, rid: str, prompt: list[int], max_tokens: int, job: ShadowJob, spent: Spent
    ) -> tuple[bool, str | None]:
        """The large tier's answer, then (unless identical) the judge's verdict on the served tier's: (good
        enough, the verdict's text). What ran goes into `spent` as it finishes, failed runs included."""
        try:
            spent.large = await self.generate(engine, f"{rid}-large", prompt, max_tokens, job.tenant_id)
        except Failed as failed:
            spent.large = failed.answer
            raise
        return await self.judge(engine, f"{rid}-judge", job, spent.large.text, job.answer_text, spent)

    async def judge(
        self, engine: TierEngine, rid: str, job: ShadowJob, reference: str, answer: str, spent: Spent
    ) -> tuple[bool, str | None]:
        """Whether `answer` is as good as the large tier's `reference` to the job's question: identical needs no
        judge; a word problem is decided by its final number; code whose prompt gives examples by running them
        (in the jail, as the `prompt_examples` check does); else the large tier (`engine`) judges as `router label`
        does. (good enough, the verdict's text); the judge's run goes into `spent.judge`."""
        if reference.strip() == answer.strip():
            return True, None
        question = split_conversation(job.messages)[0]
        agree = number_agreement(question, reference, answer)
        if agree is not None:  # a word problem: its final numbers decide, as GSM8K is graded
            return agree, None
        passed = await anyio.to_thread.run_sync(lambda: passes_prompt_examples(question, answer))
        if passed is not None:  # the prompt's own examples, run on the cheaper answer
            return passed, "prompt examples pass" if passed else "prompt examples fail"
        asked = judge_messages(question, reference, answer)
        judging = await anyio.to_thread.run_sync(engine.tokenizer.encode_chat, asked)
        try:
            engine.check(judging, JUDGE_MAX_TOKENS)
            spent.judge = await self.generate(engine, rid, judging, JUDGE_MAX_TOKENS, job.tenant_id)
        except RequestRejected:
            spent.judge = Answer()  # as `router label`: an unread comparison is no "yes"
        except Failed as failed:
            spent.judge = failed.answer
            raise
        return parse_verdict(spent.judge.text) is True, spent.judge.text

    async def generate(
        self,
        engine: TierEngine,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        tenant_id: int,
        adapter: str | None = None,
    ) -> Answer:
        """`engine`'s greedy answer at the shadow priority (under `adapter`: the engine's name for a loaded one)."""
        salt = f"tenant:{tenant_id}" if self.settings.prefix_cache_scope == "tenant" else ""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        request = EngineRequest(request_id, prompt, params, priority=SHADOW_PRIORITY, cache_salt=salt, adapter=adapter)
        pieces: list[str] = []
        try:
            stream = engine.open([request])
        except EngineUnavailable:
            raise Failed(Answer(finish="error")) from None
        failed = False
        try:
            async for out in stream:
                if out.finish_reason is FinishReason.ERROR:
                    failed = True
                    break
                pieces.append(out.text)
        except (EngineUnavailable, RequestRejected):  # a remote tier that went away, or refused the run
            failed = True
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        last = stream.last.get(request_id)
        finish = last.finish_reason.value if last is not None and last.finish_reason else "error"
        answer = Answer(
            "".join(pieces),
            len(prompt) if last is not None else 0,
            last.completion_tokens if last is not None else 0,
            last.cached_tokens if last is not None else 0,
            finish,
        )
        if failed or last is None or last.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            raise Failed(answer)
        return answer

    def append(self, row: Row) -> None:
        """Write a label row (shadow or explore) and count its verdict: the estimate counts shadow rows only
        (they judge what was served), the tenant's layer both."""
        with self._append_lock, open_appender(self.path) as append:
            append(row)
        if row.get("direction", "shadow") == "shadow":
            self.verdicts.add(row["tenant"], row[f"{row['served']}_ok"], row["served"])
        verdict = verdict_of(row)
        if verdict is not None:
            self.learning.add(str(row["tenant"]), verdict)

    async def close(self, timeout: float = 30.0) -> None:
        """Let running shadow runs finish (each writes its row), then cancel what is left."""
        await self.runs.close(timeout)
