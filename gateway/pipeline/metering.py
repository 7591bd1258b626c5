"""Metering: what ran → one priced `UsageRecord` → metrics, the ledger, and the budget settlement.

The one place a usage row is built. A request's run is billed once however it ended (the run calls
`bill` once, with its `Outcome`); a request that never ran gives its reservation back (`release`). Shadow
runs have their own rows and meter (`gateway.routing.shadow_rows`).
"""

from __future__ import annotations

from decimal import Decimal

import anyio

from gateway.accounting.ledger import Ledger
from gateway.accounting.metrics import Metrics
from gateway.accounting.record import Decisions, TokenCounts, UsageRecord
from gateway.pipeline.plan import Outcome, Plan
from gateway.pipeline.prompt_log import log_exchange
from policies.budgets import Budgets, Reservation
from policies.pricing import Charge, Tokens, charge


def priced(plan: Plan, outcome: Outcome) -> tuple[Tokens, Charge]:
    """What ran, in the pricing's terms, and its price at the prices of the tier that served."""
    work, outs = plan.work, outcome.outputs
    cached = 0  # each distinct prompt billed once: its least-cached choice
    for first in range(0, len(outs), work.choices_per_prompt):
        group = outs[first : first + work.choices_per_prompt]
        cached += min((o.cached_tokens if o else 0) for o in group)
    cut = 0  # completion tokens the policy's cap stopped: choices that ran into it
    for r, o, asked, reason in zip(work.requests, outs, work.requested_max, outcome.finish_reasons, strict=True):
        if o is not None and reason == "length" and asked > r.params.max_tokens == o.completion_tokens:
            cut += asked - r.params.max_tokens
    caps = {r.request_id: r.params.max_tokens for r in work.requests}
    tokens = Tokens(
        prompt=work.prompt_tokens,
        completion=outcome.completion_tokens,
        cached_prompt=cached,
        draft_accepted=sum(o.draft_accepted for o in outs if o),
        policy_cut=cut,
        verifier_cut=sum(h.tokens_saved(caps) for h in plan.checks.hooks),
        cache_hit=plan.cache.answer is not None,
        check_prompt=outcome.check_tokens[0],
        check_completion=outcome.check_tokens[1],
    )
    price = charge(plan.caller.policy.policy, outcome.served.name, tokens)
    if outcome.status == "escalated":
        # The retry's row holds the always-large counterfactual: this one only costs, and what it cost is the
        # cascade's own overhead, a negative verifier saving (counterfactual − cost = the levers, still).
        price = Charge(cost=price.cost, counterfactual=Decimal(0), saved_verifier=-price.cost)
    return tokens, price


def usage_record(plan: Plan, outcome: Outcome) -> tuple[UsageRecord, Tokens]:
    """The request's ledger row, and the tokens it settles."""
    tokens, price = priced(plan, outcome)
    caller = plan.caller
    rec = UsageRecord(
        request_id=caller.request_id,
        tenant_id=caller.principal.tenant_id,
        api_key_id=caller.principal.key_id,
        endpoint=caller.endpoint,
        requested_model=caller.model,
        model=outcome.served.checkpoint,
        tier=outcome.served.name,
        latency_ms=round(outcome.seconds * 1000),
        status=outcome.status,
        finish_reason="abort" if outcome.status == "aborted" else outcome.finish_reasons[0],
        tokens=TokenCounts(  # a final check's questions and answers are part of what the request ran
            prompt=tokens.prompt + tokens.check_prompt,
            completion=tokens.completion + tokens.check_completion,
            cached_prompt=tokens.cached_prompt,
            draft_proposed=sum(o.draft_proposed for o in outcome.outputs if o),
            draft_accepted=tokens.draft_accepted,
            requested_max=plan.work.requested_max_tokens,
            effective_max=plan.work.requests[0].params.max_tokens,
        ),
        decisions=Decisions(
            cache_status=plan.cache.status,
            route="direct" if plan.route is None else "auto",
            policy_version=caller.policy.version,
            verifier_actions=plan.verifier_actions,
        ),
        charge=price,
    )
    return rec, tokens


class Meter:
    """Writes what ran down and settles its reservation to the actual cost."""

    def __init__(self, ledger: Ledger, budgets: Budgets, metrics: Metrics | None = None) -> None:
        self.ledger = ledger
        self.budgets = budgets
        self.metrics = metrics

    async def bill(self, plan: Plan, outcome: Outcome) -> None:
        """Price what ran, write its ledger row, then settle the reservation to the actual cost."""
        rec, _ = usage_record(plan, outcome)
        if self.metrics is not None:
            self.metrics.record_request(rec, outcome.ttft, outcome.seconds)
        if plan.caller.policy.policy.logging.log_prompts:  # the tenant opted in to its text in our logs
            log_exchange(plan, outcome, plan.work.candidates[0].engine.tokenizer)
        await self.ledger.write(rec)  # group-committed with concurrent requests' rows
        await self.budgets.settle(plan.reservation, rec.cost, rec.tokens.prompt + rec.tokens.completion)

    async def release(self, reservation: Reservation) -> None:
        """Settle a reservation to nothing: the request never ran."""
        with anyio.CancelScope(shield=True):
            await self.budgets.settle(reservation, Decimal(0), 0)
