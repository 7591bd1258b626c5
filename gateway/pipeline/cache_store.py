"""The cache store: a finished, deterministic answer → the response cache, under the key its lookup made.

Admission's lookup leaves a key only where the answer may be stored (cacheable, and the client did not
say `no-store`); a run stores its answer once it finished `ok` on the tier the key is for. A fallback's
answer is not the requested tier's, and an aborted, failed or escalated one is no answer to repeat.
"""

from __future__ import annotations

from gateway.cache_stage import CacheStage
from gateway.pipeline.plan import Outcome, Plan


def storable(plan: Plan, outcome: Outcome) -> bool:
    return outcome.status == "ok" and outcome.served.name == plan.wanted_tier and plan.cache.key is not None


async def store(stage: CacheStage, plan: Plan, outcome: Outcome) -> None:
    if storable(plan, outcome):
        usage = (plan.work.prompt_tokens, outcome.completion_tokens)
        texts, reasons = list(outcome.texts), list(outcome.finish_reasons)
        await stage.store(
            plan.caller.principal.tenant_id, plan.cache, texts, reasons, usage, outcome.served.name, plan.request_id
        )
