"""Drift: the share of large-tier calls over the last decisions, against the share their thresholds
were calibrated to send.

A threshold calibrated on yesterday's prompts sends the calibrated share large only while traffic
looks like them; when the live share strays, the prompts changed and the threshold wants
recalibrating. Each decision brings the share its own threshold was calibrated for (tenants differ),
so the expected share of a window is their mean; decisions under a fixed threshold (policy mode
"threshold") expect nothing and count only toward the live share.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

WINDOW = 1000  # decisions: at a 25% share, ±2.7 points of sampling noise (one standard deviation: ±1.4)


@dataclass(frozen=True)
class Shares:
    decisions: int
    large_share: float | None  # None: no decisions yet
    calibrated_large_share: float | None  # None: no decision in the window had a calibrated share

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "decisions": self.decisions,
            "large_share": self.large_share,
            "calibrated_large_share": self.calibrated_large_share,
        }


class LargeShareWindow:
    """The last `size` routing decisions. Thread-safe: decisions come from the event loop, scrapes from anywhere."""

    def __init__(self, size: int = WINDOW) -> None:
        self._decisions: deque[tuple[bool, float | None]] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, large: bool, calibrated_share: float | None) -> None:
        with self._lock:
            self._decisions.append((large, calibrated_share))

    def shares(self) -> Shares:
        with self._lock:
            decisions = list(self._decisions)
        if not decisions:
            return Shares(0, None, None)
        expected = [s for _, s in decisions if s is not None]
        return Shares(
            decisions=len(decisions),
            large_share=sum(large for large, _ in decisions) / len(decisions),
            calibrated_large_share=sum(expected) / len(expected) if expected else None,
        )
