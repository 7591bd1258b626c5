"""One KV memory budget in bytes shared by several engines (tiers, and a tier's draft model).

Each engine keeps its own paged pool with its own block shape (a 0.5B and a 1.5B model's blocks
differ in bytes), sized to the whole budget but allocated lazily: pages are touched only as blocks
are first used. What is shared is the right to hold blocks: a block in use by some sequence charges
its bytes here, and an engine may take a block only while the budget has room. So a busy tier can
use what an idle one does not, and under load both queue for the same bytes instead of one starving
behind a fixed split. Fairness: while an engine is refused blocks, the others may not grow past an
equal share of the budget, so as their sequences finish the refused one gets room.

Cached free blocks (prefix cache) do not count: their owner reuses or evicts them. So resident
memory can exceed the budget by what idle engines keep cached (each engine's touched pages stay).
Engines run on their own threads, so the counter is locked; a check and the allocation that
follows it are not one atomic step, so two engines allocating at the same instant may overshoot by
one step's blocks (never a failure: each pool has room for the whole budget).
"""

from __future__ import annotations

import threading
import time


class KVBudget:
    BLOCKED_FOR = 1.0  # seconds a refusal keeps an engine marked as waiting (each retry renews it)

    def __init__(self, total_bytes: int) -> None:
        if total_bytes < 1:
            raise ValueError("the KV budget must be positive")
        self.total_bytes = total_bytes
        self._used = 0
        self._lock = threading.Lock()
        self.by_owner: dict[str, int] = {}
        self._blocked: dict[str, float] = {}  # owner → when it was last refused

    @property
    def used_bytes(self) -> int:
        return self._used

    def register(self, owner: str) -> None:
        with self._lock:
            self.by_owner.setdefault(owner, 0)

    def has_room(self, owner: str, nbytes: int, *, optional: bool = False) -> bool:
        """Whether `owner` may take `nbytes` more. A refusal of a needed (not `optional`) allocation
        marks the owner as waiting, which caps every other owner at an equal share until it gets room."""
        now = time.monotonic()
        with self._lock:
            room = self._used + nbytes <= self.total_bytes
            waiting = [o for o, t in self._blocked.items() if o != owner and now - t < self.BLOCKED_FOR]
            if room and waiting:
                share = self.total_bytes // max(1, len(self.by_owner))
                room = self.by_owner.get(owner, 0) + nbytes <= share
            if not room and not optional:
                self._blocked[owner] = now
            return room

    def charge(self, owner: str, nbytes: int) -> None:
        with self._lock:
            self._used += nbytes
            self.by_owner[owner] = self.by_owner.get(owner, 0) + nbytes
            self._blocked.pop(owner, None)

    def release(self, owner: str, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes
            self.by_owner[owner] = self.by_owner.get(owner, 0) - nbytes
