"""The router's hidden-state feature at serving time: the small tier's prefill of the conversation.

A router trained on the small tier's hidden state (`router_model.hidden`) asks that tier for it: one
prefill-only request inside the small engine's continuous batching, never beside it, with the request's
own prefix-cache salt, so a request then routed small finds its prompt's full blocks cached and pays for
no second prefill; one routed large has paid for the small tier's prefill (about a third of the large
one's: 0.5B against 1.5B parameters). The state is the one training saw: the client's messages through
the small tier's chat template (a policy's system instruction is added after routing, so those prompts
miss the cache).

The text-only router is the fallback, per request, whenever the state is not at hand in time: the small
tier is not a local engine or not running, its model is not the one the router was trained on, more than
`max_waiting` requests wait in its queue, or the prefill takes longer than `timeout_s`. Each outcome is
counted (`counts`), for `GET /v1/admin/router`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping

import numpy as np

from engines.async_engine import AsyncEngine
from engines.protocol import TierEngine
from router_model.hidden import HiddenSpec

log = logging.getLogger(__name__)


class HiddenStateSource:
    def __init__(self, engine: TierEngine | None, model: str | None, *, max_waiting: int, timeout_s: float) -> None:
        """`engine`: the small tier's; `model`: what it serves, as labels name it (`router_model.label.tier_model`)."""
        self.engine = engine
        self.model = model
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.counts: Counter[str] = Counter()  # used, or why the text router decided instead
        self._warned: set[str] = set()

    async def state(self, spec: HiddenSpec, messages: list[Mapping[str, object]], salt: str) -> np.ndarray | None:
        """The conversation's hidden state as `spec` wants it, or None (the text router decides)."""
        engine = self.engine
        why = self._unusable(spec)
        if why is None and isinstance(engine, AsyncEngine) and engine.stats().queue.waiting > self.max_waiting:
            why = "busy"
        if why is not None or not isinstance(engine, AsyncEngine):
            self.counts[why or "not_local"] += 1
            return None
        try:
            ids = engine.tokenizer.encode_chat([dict(m) for m in messages])
            state = await asyncio.wait_for(engine.hidden_state(ids, spec.layer, cache_salt=salt), self.timeout_s)
        except TimeoutError:
            self.counts["timeout"] += 1
            return None
        except Exception as exc:  # the prompt may not fit, the engine may stop: route on text
            self.counts["failed"] += 1
            log.warning("hidden state for routing failed (%s): routing on text", type(exc).__name__)
            return None
        self.counts["used"] += 1
        return state.numpy()

    def _unusable(self, spec: HiddenSpec) -> str | None:
        if not isinstance(self.engine, AsyncEngine):
            return "not_local"
        if not self.engine.alive:
            return "down"
        if spec.model != self.model or spec.dim != self.engine.engine.model.config.hidden_size:
            if spec.model not in self._warned:
                self._warned.add(spec.model)
                log.warning("the router was trained on %s's hidden state, the small tier serves %s: routing on text",
                            spec.model, self.model)  # fmt: skip
            return "other_model"
        return None
