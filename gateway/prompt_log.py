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
    from gateway.pipeline import Generation

log = logging.getLogger(__name__)


def log_exchange(gen: Generation, tokenizer: Tokenizer) -> None:
    """Never raises: it runs while the request is being billed, which must not fail because of a log line."""
    try:
        _log(gen, tokenizer)
    except Exception:  # no traceback: its messages could quote the text
        log.warning("could not log the prompt and completion", extra={"request_id": gen.request_id})


def _log(gen: Generation, tokenizer: Tokenizer) -> None:
    per_prompt = max(1, len(gen.requests) // max(1, gen.num_prompts))  # n choices share each prompt
    prompts = [tokenizer.decode(r.prompt_token_ids) for r in gen.requests[::per_prompt]]
    completions = list(gen.cache.answer.texts) if gen.cache.answer is not None else list(gen.texts)
    log.info(
        "prompt and completion",
        extra={
            "request_id": gen.request_id,
            "tenant_id": gen.principal.tenant_id,
            "endpoint": gen.endpoint,
            "tier": gen.model,
            "outcome": gen.status,
            "prompts": prompts,
            "completions": completions,
        },
    )
