"""The cache store: a finished, deterministic answer → the response cache, under the key its lookup made.

Admission's lookup leaves a key only where the answer may be stored (cacheable, and the client did not
say `no-store`); a run stores its answer once it finished `ok` on the tier the key is for. A fallback's
answer is not the requested tier's, and an aborted, failed or escalated one is no answer to repeat.
"""

from __future__ import annotations

import time

from gateway.cache.exact import CachedAnswer
from gateway.cache.stage import CacheStage
from gateway.pipeline.plan import Outcome, Plan


def storable(plan: Plan, outcome: Outcome) -> bool:
    """A finished answer of the tier asked for that passed every final check: one that failed a check is
    served (and reported) when nothing retries it, but never replayed to later requests."""
    return (
        outcome.status == "ok"
        and outcome.served.name == plan.wanted_tier
        and plan.cache.key is not None
        and not any(h.failed for h in plan.checks.hooks)
    )


def answer(plan: Plan, outcome: Outcome) -> CachedAnswer | None:
    """The answer as the cache keeps it (and single-flight followers get it), or None if it is not to be kept."""
    if not storable(plan, outcome):
        return None
    texts, reasons = list(outcome.texts), list(outcome.finish_reasons)
    usage = (plan.work.prompt_tokens, outcome.completion_tokens)
    return CachedAnswer(texts, reasons, *usage, outcome.served.name, plan.request_id, int(time.time()))


async def store(stage: CacheStage, plan: Plan, outcome: Outcome) -> None:
    if (found := answer(plan, outcome)) is not None:
        await stage.store(plan.caller.principal.tenant_id, plan.cache, found)
