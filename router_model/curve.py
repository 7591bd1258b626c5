"""The router's cost-against-quality curve on one set of prompts, threshold by threshold: what an admin
chooses between when setting a tenant's routing (the console's routing form draws it).

A threshold t sends a prompt to the large tier when P(small is good enough) < t. For every threshold
that does not split a tie, the curve has a point: the threshold, the share of prompts it sends large
(what calibration aims at; ~ cost, see `relative_cost`) and the quality, the share answered right:
`large_ok` where routed large, `small_ok` elsewhere. The outcomes may be labels (bools: measured
quality, as `router_model.evaluate.quality_curve` computes it) or probabilities (expected quality,
e.g. the router's own P(small is good enough) on unlabeled prompts). Read-only: nothing here trains,
calibrates or stores anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Outcomes = Sequence[float] | Sequence[bool] | np.ndarray


@dataclass(frozen=True)
class CurvePoint:
    threshold: float  # large when P(small is good enough) < threshold
    large_share: float  # 0-1: the share of the prompts sent to the large tier
    quality: float  # 0-1: the share answered right (expected, where the outcomes are probabilities)


@dataclass(frozen=True)
class RoutingCurve:
    points: list[CurvePoint]  # large shares ascending, from 0 (all small) to 1 (all large)
    n: int  # prompts

    @property
    def q_small(self) -> float:
        return self.points[0].quality

    @property
    def q_large(self) -> float:
        return self.points[-1].quality


def routing_curve(p_small_ok: Outcomes, small_ok: Outcomes, large_ok: Outcomes) -> RoutingCurve:
    """The curve over every threshold: the k lowest P(small is good enough) go large, for every k between
    tie groups; each point's threshold is the midpoint between the k-th and the (k+1)-th probability
    (as `router_model.calibrate` places it), 0 for none large and 1 for all."""
    p = np.asarray(p_small_ok, float)
    small, large = _outcomes(small_ok, len(p)), _outcomes(large_ok, len(p))
    if len(p) == 0:
        raise ValueError("no prompts to draw a curve on")
    order = np.argsort(p, kind="stable")
    s = p[order]
    quality = (small.sum() + np.concatenate([[0.0], np.cumsum(large[order] - small[order])])) / len(p)
    keep = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1], [True]]))
    points = [CurvePoint(_threshold_at(s, int(k)), float(k / len(p)), float(quality[k])) for k in keep]
    return RoutingCurve(points, len(p))


def operating_point(p_small_ok: Outcomes, small_ok: Outcomes, large_ok: Outcomes, threshold: float) -> CurvePoint:
    """Where `threshold` lands on these prompts: the share it sends large and the quality there."""
    p = np.asarray(p_small_ok, float)
    if len(p) == 0:
        raise ValueError("no prompts to place a threshold on")
    large = p < threshold
    ok = np.where(large, _outcomes(large_ok, len(p)), _outcomes(small_ok, len(p)))
    return CurvePoint(float(threshold), float(large.mean()), float(ok.mean()))


def relative_cost(large_share: float, price_ratio: float) -> float:
    """The cost of routing at `large_share` relative to sending everything large, where a small-tier
    request costs `price_ratio` of a large one (both tiers writing as many tokens)."""
    return large_share + (1.0 - large_share) * price_ratio


def _outcomes(values: Outcomes, n: int) -> np.ndarray:
    out = np.asarray(values, float)
    if out.shape != (n,):
        raise ValueError(f"expected {n} outcomes, got {out.shape[0] if out.ndim else 0}")
    if ((out < 0) | (out > 1)).any() or np.isnan(out).any():
        raise ValueError("outcomes are labels or probabilities, within [0, 1]")
    return out


def _threshold_at(sorted_p: np.ndarray, k: int) -> float:
    if k <= 0:
        return 0.0
    if k >= len(sorted_p):
        return 1.0
    return float((sorted_p[k - 1] + sorted_p[k]) / 2)
