"""What follows a response once it is out (never on its path): the routed conversation kept for
calibration (`RoutingStage.store`, where the policy says `router.store_prompts`), a fresh tiny- or
small-tier chat answer offered to the relabeler for a shadow run (`gateway.routing.shadow`), and a fresh
large-tier one to the explorer for runs on the cheaper tiers (`gateway.routing.explore`), as it went out.
Requests with tools get neither: their runs would need the request's tools and grammar, which a verdict on the
conversation's text alone does not have (they stay on the tiers whose tool quality is known).
"""

from __future__ import annotations

from gateway.pipeline.plan import Outcome, Plan
from gateway.routing.shadow_rows import ShadowJob
from gateway.routing.stage import RoutingStage
from router_model.kinds import TEXT

__all__ = ["after_response", "shadow_job"]


def after_response(routing: RoutingStage, plan: Plan, outcome: Outcome) -> None:
    """Once the response is out: store the conversation, maybe start a shadow run. Never blocks."""
    route = plan.route
    if route is None or outcome.status != "ok":
        return
    caller = plan.caller
    if caller.policy.policy.router.store_prompts and route.features != "lock":  # a locked turn was not decided
        routing.store(caller.principal.tenant_id, plan.request_id, plan.conversations, route)
    fresh = plan.cache.answer is None  # a cached answer is not a new answer of its tier
    relabeler, explorer = routing.relabeler, routing.explorer
    if relabeler is None or not fresh or caller.endpoint == "completions" or route.kind != TEXT:
        return
    if route.features == "lock":  # a tool loop's turn: not decided, not judged
        return
    served, tenant = outcome.served.name, caller.principal.tenant_name
    if relabeler.wants(caller.policy, served, tenant):
        relabeler.submit(shadow_job(plan, outcome))
        return
    tiers = routing.cheaper_tiers(caller.policy.policy)
    if explorer is not None and explorer.wants(caller.policy, served, tenant, route.router, tiers):
        explorer.submit(shadow_job(plan, outcome, tuple(tiers)))


def shadow_job(plan: Plan, outcome: Outcome, explore: tuple[str, ...] = ()) -> ShadowJob:
    """The shadow job for a routed chat request's first answer, as it went out."""
    caller = plan.caller
    return ShadowJob(
        request_id=caller.request_id,
        endpoint=caller.endpoint,
        tenant_id=caller.principal.tenant_id,
        tenant=caller.principal.tenant_name,
        key_id=caller.principal.key_id,
        policy=caller.policy,
        messages=[{"role": str(m["role"]), "content": str(m["content"])} for m in plan.conversations[0]],
        answer_text=outcome.texts[0],
        answer_tokens=outcome.choice_tokens[0],
        answer_finish=outcome.finish_reasons[0],
        max_tokens=plan.work.requests[0].params.max_tokens,
        served=outcome.served.name,
        cell=plan.route.cell if plan.route is not None else None,
        router=plan.route.router if plan.route is not None else "",
        explore=explore,
    )
