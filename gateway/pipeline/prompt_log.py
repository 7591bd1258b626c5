"""Prompt logging, for the tenants whose policy opts in (`logging.log_prompts`); off by default.

One INFO line per finished request, in the structured log, with its request id (the log's own field)
and tenant id: the prompts as the model saw them (chat template included, decoded from the token ids
it ran on) and each choice's completion. Nothing else in the gateway logs prompt or completion text.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engines.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gateway.pipeline.plan import Outcome, Plan

log = logging.getLogger(__name__)


def log_exchange(plan: Plan, outcome: Outcome, tokenizer: Tokenizer) -> None:
    """Never raises: it runs while the request is being billed, which must not fail because of a log line."""
    try:
        _log(plan, outcome, tokenizer)
    except Exception:  # no traceback: its messages could quote the text
        log.warning("could not log the prompt and completion", extra={"request_id": plan.request_id})


def _log(plan: Plan, outcome: Outcome, tokenizer: Tokenizer) -> None:
    requests = plan.work.requests
    prompts = [tokenizer.decode(r.prompt_token_ids) for r in requests[:: plan.work.choices_per_prompt]]
    log.info(
        "prompt and completion",
        extra={
            "request_id": plan.request_id,
            "tenant_id": plan.caller.principal.tenant_id,
            "endpoint": plan.caller.endpoint,
            "tier": plan.caller.model,
            "outcome": outcome.status,
            "prompts": prompts,
            "completions": list(outcome.texts),  # a cached answer's texts on a hit
        },
    )
