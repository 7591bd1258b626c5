"""`Pipeline`: the request pipeline's entry points, over the stores and stages it runs on; and a non-streamed
request's `Answer`, through the cascade (`complete`: the first attempt, then its retry if it escalated)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from core.settings import Settings
from engines.protocol import TierEngine
from gateway.accounting.ledger import Ledger
from gateway.accounting.metrics import Metrics
from gateway.accounting.tenants import Principal
from gateway.adapters import AdapterStore
from gateway.cache.stage import CacheStage
from gateway.http.errors import APIError
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from gateway.pipeline.admission import Admission, tier_lock
from gateway.pipeline.aliases import ALIAS_TARGETS
from gateway.pipeline.metering import Meter
from gateway.pipeline.plan import Plan
from gateway.pipeline.policy_check import validate_policy
from gateway.pipeline.prompts import Body
from gateway.pipeline.run import Generation, Watch
from gateway.pipeline.wires import CHAT, WIRES, Wire
from gateway.routing.stage import RoutingStage
from policies.budgets import Budgets
from policies.policy import Policy
from policies.store import PolicyStore
from verifiers.probe import AnswerProbe


@dataclass(frozen=True)
class Answer:
    """A non-streamed request's answer: whose it is, its choices, and the first attempt if it was retried."""

    generation: Generation  # whose answer goes out: the retry's, or the first attempt's
    texts: list[str]
    reasons: list[str | None]
    first: Generation  # the first attempt (`generation` itself when there was no retry)
    refused: str | None = None  # the retry's error code (or status) when it failed: the first answer stands

    @property
    def escalated(self) -> bool:
        return self.generation is not self.first


async def complete(gen: Generation, retry: Callable[[], Awaitable[Generation]], watch: Watch) -> Answer:
    """Run `gen` to its end (`watch` aborts it if the client leaves), then `retry()` if its answer failed."""
    try:
        # A cached answer is ready at once: no generation to abort, so no disconnect watcher to start.
        work = gen.collect()
        texts, reasons = await (work if gen.plan.cache.answer is not None else watch(work))
    finally:
        await gen.abandon()  # a no-op once it ran
    if gen.escalation is None:
        return Answer(gen, texts, reasons, gen)
    try:
        second = await retry()
        try:
            retried = await watch(second.collect())
        finally:
            await second.abandon()
    except APIError as exc:  # the larger tier refused (budget, rate limit, down): the first answer stands
        return Answer(gen, texts, reasons, gen, refused=str(exc.code or exc.status))
    return Answer(second, *retried, gen)


class Pipeline(Admission):
    """Admits requests (`start_chat`, `start_completion`) into generations that meter themselves, and runs a
    non-streamed one to its answer, through the cascade (`complete`)."""

    def __init__(
        self,
        engines: Mapping[str, TierEngine],
        ledger: Ledger,
        settings: Settings,
        policies: PolicyStore,
        budgets: Budgets,
        cache: CacheStage | None = None,
        metrics: Metrics | None = None,
        routing: RoutingStage | None = None,
        probe: AnswerProbe | None = None,
        adapters: AdapterStore | None = None,
    ) -> None:
        super().__init__(engines, settings, policies, budgets, cache, metrics, routing, probe, adapters)
        self.ledger = ledger
        self.meter = Meter(ledger, budgets, metrics)

    async def start_chat(
        self,
        principal: Principal,
        body: ChatCompletionRequest,
        cache_header: str | None = None,
        escalated_from: str | None = None,
        wire: Wire = CHAT,
        continued: bool = False,
    ) -> Generation:
        """A chat-shaped request, from whichever API `wire` names (translated to chat by its route); `continued`:
        it continues a stored response (its tier lock applies)."""
        plan = await self.admit_chat(principal, body, cache_header, escalated_from, wire, continued)
        return self._generation(plan)

    async def start_completion(
        self,
        principal: Principal,
        body: CompletionRequest,
        cache_header: str | None = None,
        escalated_from: str | None = None,
    ) -> Generation:
        return self._generation(await self.admit_completion(principal, body, cache_header, escalated_from))

    async def complete(self, gen: Generation, body: Body, watch: Watch) -> Answer:
        """Run a non-streamed generation to its answer; one whose answer failed a final check is retried on the
        cascade's tier (`gateway.pipeline.cascade`)."""
        return await complete(gen, lambda: self.escalate(gen, body), watch)

    async def escalate(self, gen: Generation, body: Body) -> Generation:
        """A new generation of `body` on the tier `gen`'s failed answer escalates to (its own reservation and
        ledger row; not routed and not escalated again; the client's cache settings apply)."""
        assert gen.escalation is not None
        retry = body.model_copy(update={"model": gen.escalation})
        principal = gen.plan.caller.principal
        if isinstance(retry, ChatCompletionRequest):
            wire = WIRES[gen.plan.caller.endpoint]  # the retry is billed under the same API
            if gen.plan.route is not None:  # a routed tool loop stays on the tier it escalated to
                self.routing.locks.move(tier_lock(principal, body).key, gen.escalation)
            return await self.start_chat(principal, retry, escalated_from=gen.request_id, wire=wire)
        return await self.start_completion(principal, retry, escalated_from=gen.request_id)

    def served_policy(self, body: dict[str, Any]) -> Policy:
        """`validate_policy` against what this gateway serves: its tiers, and whether it has a probe (a 422)."""
        return validate_policy(body, list(self.engines), probe=self.probe is not None, callable_=ALIAS_TARGETS)

    def _generation(self, plan: Plan) -> Generation:
        return Generation(plan, self.meter, self.cache, self.routing)
