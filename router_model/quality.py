"""A tenant's quality under `auto` against always-large, estimated from its own shadow runs.

Shadow relabeling (`gateway.routing.shadow`) re-runs a share of the answers a cheaper tier (tiny, small) served
on the large tier and has the large tier judge them: each run is a verdict "the cheaper answer was good
enough" (the large answer is the reference, as `router label` grades open chat). The requests the
router sent large are large's by definition. So, with c_t the share of the tenant's routed requests
tier t served and p_t the share of t's judged answers found good enough,

    quality ratio = 1 - sum over the cheaper tiers t of c_t · (1 - p_t)

(what share of its answers are as good as always-large's would have been). A tier with a share but no
verdict of its own is counted at the pooled p of the tenant's verdicts. The interval is Wilson's 95%
score interval on each p_t carried through the same line, (0, 1) for a tier without verdicts: the
shares are counted, not sampled (every decision is known), and summing the tiers' ends is conservative
(wider than the joint interval). With no verdict at all there is no estimate.

`recalibrated_offset` is the rule that answers a shortfall: when the interval's upper end is below the
tenant's floor on at least `MIN_VERDICTS` fresh verdicts, the held-out curve is aimed higher by the
measured shortfall (floor − ratio).
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

Z95 = 1.959964  # the standard normal's two-sided 95% quantile
MIN_VERDICTS = 30  # fresh verdicts before a recalibration: at p = 0.8 the interval is then about ±0.14 on p
WINDOW = 1000  # the decisions a tenant's served shares are counted over


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
    tiers: dict[str, dict[str, float | int]] = field(default_factory=dict)  # tier → share, ok, judged

    def as_dict(self) -> dict[str, Any]:
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items() if k != "tiers"}
        out["tiers"] = {t: {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}
                        for t, d in self.tiers.items()}  # fmt: skip
        return out


def estimate(cheaper: Mapping[str, float], verdicts: Mapping[str, tuple[int, int]]) -> QualityEstimate | None:
    """The quality ratio and its interval (see the module's docstring); None without a verdict.

    `cheaper`: tier → the share of routed requests it served (tiers below large); `verdicts`: tier →
    (good enough, judged)."""
    ok_all = sum(ok for ok, _ in verdicts.values())
    judged_all = sum(n for _, n in verdicts.values())
    if judged_all <= 0:
        return None
    pooled = ok_all / judged_all
    ratio = low = high = 1.0
    tiers: dict[str, dict[str, float | int]] = {}
    for tier in sorted(set(cheaper) | set(verdicts)):
        c = min(max(cheaper.get(tier, 0.0), 0.0), 1.0)
        ok, n = verdicts.get(tier, (0, 0))
        p = ok / n if n else pooled
        low_p, high_p = wilson(ok, n)
        ratio -= c * (1 - p)
        low -= c * (1 - low_p)
        high -= c * (1 - high_p)
        tiers[tier] = {"share": c, "ok": ok, "judged": n}
    return QualityEstimate(
        ratio=max(0.0, ratio),
        low=max(0.0, low),
        high=max(0.0, high),
        judged=judged_all,
        ok=ok_all,
        cheaper_share=min(1.0, sum(t["share"] for t in tiers.values())),
        tiers=tiers,
    )


def recalibrated_offset(found: QualityEstimate | None, floor: float, offset: float) -> float | None:
    """The new offset above `floor` at which to aim the held-out curve, or None for no change: the estimate
    (on fresh verdicts only) must rest on `MIN_VERDICTS` and its upper end be below the floor. The offset
    grows by the shortfall (floor − ratio), up to the curve's top (1)."""
    if found is None or found.judged < MIN_VERDICTS or found.high >= floor:
        return None
    raised = min(1.0 - floor, offset + (floor - found.ratio))
    return raised if raised > offset + 1e-9 else None


class TenantVerdicts:
    """Shadow verdicts per tenant name, in order, with the tier whose answer each judged. Thread-safe;
    loaded from the live label rows."""

    def __init__(self) -> None:
        self._verdicts: dict[str, list[tuple[str, bool]]] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, ok: bool, tier: str = "small") -> None:
        with self._lock:
            self._verdicts.setdefault(tenant, []).append((tier, bool(ok)))

    def load(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Count the live label rows that name their tenant (`gateway.routing.shadow` writes `tenant`, and `served`
        since tiny answers are judged too; older rows judged the small tier's)."""
        for row in rows:
            tier = str(row.get("served", "small"))
            if row.get("direction", "shadow") != "shadow":  # an explore row judged a tier that did not serve
                continue
            if row.get("source") == "live" and isinstance(row.get("tenant"), str) and f"{tier}_ok" in row:
                self.add(row["tenant"], bool(row[f"{tier}_ok"]), tier)

    def judged(self, tenant: str) -> int:
        with self._lock:
            return len(self._verdicts.get(tenant, ()))

    def counts(self, tenant: str, since: int = 0) -> dict[str, tuple[int, int]]:
        """tier → (good enough, judged) over the tenant's verdicts after the first `since` (all of them where
        there are fewer: the log was started afresh)."""
        with self._lock:
            verdicts = self._verdicts.get(tenant, [])
            recent = verdicts[since:] if since <= len(verdicts) else verdicts
            ok = Counter(tier for tier, good in recent if good)
            judged = Counter(tier for tier, _ in recent)
        return {tier: (ok[tier], n) for tier, n in judged.items()}


class ServedTiers:
    """Per tenant, the tier that served each of its last `WINDOW` routed requests. Thread-safe."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._served: dict[str, deque[str]] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, tier: str) -> None:
        with self._lock:
            self._served.setdefault(tenant, deque(maxlen=self.window)).append(tier)

    def shares(self, tenant: str) -> dict[str, float]:
        """tier → the share of the tenant's window it served; {} before its first routed request."""
        with self._lock:
            served = list(self._served.get(tenant, ()))
        return {tier: n / len(served) for tier, n in Counter(served).items()} if served else {}
