"""What both parts of `bench.ledger` print with: progress lines, percentiles, milliseconds."""

from __future__ import annotations

import sys

__all__ = ["ms", "pct", "say"]


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
