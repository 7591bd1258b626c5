"""A tenant's quality under `auto` against always-large, estimated from its own shadow runs.

Shadow relabeling (`gateway.shadow`) re-runs a share of the answers a cheaper tier served on the large
tier and has the large tier judge them: each run is a verdict "the cheaper answer was good enough" (the
large answer is the reference, as `router label` grades open chat). The requests the router sent large
are large's by definition. So, with c the share of the tenant's routed requests served below large and p
the share of judged cheaper answers found good enough,

    quality ratio = 1 - c · (1 - p)

(what share of its answers are as good as always-large's would have been). The interval is Wilson's
95% score interval on p carried through the same line (c is counted, not sampled: every decision is
known). With no verdict yet there is no estimate.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

Z95 = 1.959964  # the standard normal's two-sided 95% quantile


def wilson(ok: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion ok/n; (0, 1) with no observation."""
    if n <= 0:
        return 0.0, 1.0
    p = ok / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    denominator = 1 + z * z / n
    return max(0.0, (centre - spread) / denominator), min(1.0, (centre + spread) / denominator)


@dataclass(frozen=True)
class QualityEstimate:
    ratio: float  # estimated quality / always-large's
    low: float  # its 95% interval
    high: float
    judged: int  # shadow verdicts behind it
    ok: int  # of them, cheaper answers found good enough
    cheaper_share: float  # share of the routed requests served below large

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def estimate(cheaper_share: float, ok: int, judged: int) -> QualityEstimate | None:
    """The quality ratio and its interval (see the module's docstring); None without a verdict."""
    if judged <= 0:
        return None
    low_p, high_p = wilson(ok, judged)
    c = min(max(cheaper_share, 0.0), 1.0)
    return QualityEstimate(
        ratio=1 - c * (1 - ok / judged),
        low=1 - c * (1 - low_p),
        high=1 - c * (1 - high_p),
        judged=judged,
        ok=ok,
        cheaper_share=c,
    )


class TenantVerdicts:
    """Shadow verdicts per tenant name: (good enough, judged). Thread-safe; loaded from label rows."""

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, ok: bool) -> None:
        with self._lock:
            counts = self._counts.setdefault(tenant, [0, 0])
            counts[0] += bool(ok)
            counts[1] += 1

    def load(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Count the live label rows that name their tenant (`gateway.shadow` writes `tenant`)."""
        for row in rows:
            if row.get("source") == "live" and isinstance(row.get("tenant"), str):
                self.add(row["tenant"], bool(row.get("small_ok")))

    def counts(self, tenant: str) -> tuple[int, int]:
        with self._lock:
            ok, judged = self._counts.get(tenant, (0, 0))
        return ok, judged
