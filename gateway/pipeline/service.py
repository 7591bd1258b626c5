"""`Pipeline`: the request pipeline's entry points, over the stores and stages it runs on."""

from __future__ import annotations

from collections.abc import Mapping

from core.settings import Settings
from engines.protocol import TierEngine
from gateway.cache_stage import CacheStage
from gateway.ledger import Ledger
from gateway.metrics import Metrics
from gateway.pipeline import cascade
from gateway.pipeline.admission import Admission
from gateway.pipeline.metering import Meter
from gateway.pipeline.plan import Plan
from gateway.pipeline.prompts import Body
from gateway.pipeline.run import Generation, Watch
from gateway.routing import RoutingStage
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.tenants import Principal
from policies.budgets import Budgets
from policies.store import PolicyStore
from verifiers.probe import AnswerProbe


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
    ) -> None:
        super().__init__(engines, settings, policies, budgets, cache, metrics, routing, probe)
        self.ledger = ledger
        self.meter = Meter(ledger, budgets, metrics)

    async def start_chat(
        self,
        principal: Principal,
        body: ChatCompletionRequest,
        cache_header: str | None = None,
        escalated_from: str | None = None,
    ) -> Generation:
        return self._generation(await self.admit_chat(principal, body, cache_header, escalated_from))

    async def start_completion(
        self,
        principal: Principal,
        body: CompletionRequest,
        cache_header: str | None = None,
        escalated_from: str | None = None,
    ) -> Generation:
        return self._generation(await self.admit_completion(principal, body, cache_header, escalated_from))

    async def complete(self, gen: Generation, body: Body, watch: Watch) -> cascade.Answer:
        """Run a non-streamed generation to its answer; one whose answer failed a final check is retried on the
        cascade's tier (`gateway.pipeline.cascade`)."""
        return await cascade.complete(gen, lambda: self.escalate(gen, body), watch)

    async def escalate(self, gen: Generation, body: Body) -> Generation:
        """A new generation of `body` on the tier `gen`'s failed answer escalates to (its own reservation and
        ledger row; not routed and not escalated again; the client's cache settings apply)."""
        assert gen.escalation is not None
        retry = body.model_copy(update={"model": gen.escalation})
        principal = gen.plan.caller.principal
        if isinstance(retry, ChatCompletionRequest):
            return await self.start_chat(principal, retry, escalated_from=gen.request_id)
        return await self.start_completion(principal, retry, escalated_from=gen.request_id)

    def _generation(self, plan: Plan) -> Generation:
        return Generation(plan, self.meter, self.cache, self.routing)
