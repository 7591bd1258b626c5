"""A circuit breaker for a remote engine: stop calling a server that keeps failing, then probe it.

    closed     calls go through; `failures` consecutive failures open it
    open       calls are refused for `cooldown_s` (the gateway falls back meanwhile)
    half_open  after the cooldown, one trial call goes through: success closes it, failure reopens it

Used from one event loop only, so it needs no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

State = Literal["closed", "open", "half_open"]
Admission = Literal["call", "trial"]


class CircuitBreaker:
    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ValueError("a breaker needs failures >= 1 and a positive cooldown")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._open = False
        self._opened_at = 0.0
        self._trial = False  # a half-open trial call is in flight
        self.consecutive_failures = 0
        self.times_opened = 0

    @property
    def state(self) -> State:
        if not self._open:
            return "closed"
        if self._trial or self._clock() - self._opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def admit(self) -> Admission | None:
        """May a call go out now (None: no)? In half-open state only one may, the trial, until its verdict."""
        state = self.state
        if state == "closed":
            return "call"
        if state == "open" or self._trial:
            return None
        self._trial = True
        return "trial"

    def record_success(self) -> None:
        self._open = self._trial = False
        self.consecutive_failures = 0

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        if self._trial or (not self._open and self.consecutive_failures >= self.failures):
            self._open, self._trial = True, False
            self._opened_at = self._clock()
            self.times_opened += 1

    def release(self, admission: Admission) -> None:
        """A call ended with no verdict (its client left); if it was the trial, the next call is."""
        if admission == "trial":
            self._trial = False

    def as_dict(self) -> dict[str, str | int]:
        return {
            "breaker": self.state,
            "breaker_open": int(self.state == "open"),
            "breaker_consecutive_failures": self.consecutive_failures,
            "breaker_times_opened": self.times_opened,
        }
