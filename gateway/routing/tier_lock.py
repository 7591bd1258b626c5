"""Tool loops stay on one tier: a routed conversation's later turns go where its first turn went.

Routing each turn of an agent's loop afresh can switch tiers in the middle of a tool-call sequence, losing the
KV prefix the loop built and handing a model calls another model wrote (vLLM Semantic Router counted 3,836 unsafe
switches in 21,600 agent turns routed per turn, 0 with a session lock). A conversation is known by its opening
(every turn up to and including the first user turn, per tenant); a turn that continues one (it carries the
assistant's tool calls or their results, or it continues a stored response) is sent to the tier its opening was
routed to, while the lock lasts. A cascade that escalates a turn moves the lock to the larger tier. A new
conversation with the same opening routes afresh and takes the lock over.

In process: each replica holds its own locks, at most `MAX_LOCKS`, each for `TTL_S` after its last use.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_LOCKS", "TTL_S", "TierLocks", "continues", "opening_key"]

TTL_S = 900.0  # an agent's turns come seconds apart; a loop idle for 15 minutes routes afresh
MAX_LOCKS = 50_000  # ~100 bytes each: a few MB at most


def opening_key(tenant_id: int, messages: Sequence[Mapping[str, Any]]) -> str:
    """The conversation's identity: its turns up to and including the first user turn, per tenant."""
    opening = []
    for m in messages:
        opening.append([m.get("role"), m.get("content")])
        if m.get("role") == "user":
            break
    return hashlib.sha256(json.dumps([tenant_id, opening], default=str).encode()).hexdigest()


def continues(messages: Sequence[Mapping[str, Any]]) -> bool:
    """A turn inside a tool loop: the conversation carries the assistant's tool calls or a tool's result."""
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


class TierLocks:
    def __init__(self, ttl_s: float = TTL_S, max_locks: int = MAX_LOCKS) -> None:
        self.ttl_s, self.max_locks = ttl_s, max_locks
        self._locks: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key → (tier, expires), oldest first

    def get(self, key: str) -> str | None:
        """The locked tier, refreshed; None when there is none or it expired."""
        held = self._locks.get(key)
        if held is None or held[1] < time.monotonic():
            self._locks.pop(key, None)
            return None
        self.hold(key, held[0])
        return held[0]

    def hold(self, key: str, tier: str) -> None:
        self._locks[key] = (tier, time.monotonic() + self.ttl_s)
        self._locks.move_to_end(key)
        while len(self._locks) > self.max_locks:
            self._locks.popitem(last=False)

    def move(self, key: str, tier: str) -> None:
        """An escalated turn: the loop stays on the larger tier from here (only where a lock is held)."""
        if key in self._locks:
            self.hold(key, tier)

    def __len__(self) -> int:
        return len(self._locks)
