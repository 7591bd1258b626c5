"""RouteLLM-style evaluation: quality against the share of large-tier calls, PGR, APGR and CPT.

A router scores each prompt (higher = more likely the small tier is good enough); sweeping the threshold
routes the lowest-scored prompts to the large tier. At a large-tier share c:
- quality(c): the fraction of prompts answered acceptably, `large_ok` for those routed large and
  `small_ok` for the rest;
- PGR(c) = (quality(c) - q_small) / (q_large - q_small), where q_small and q_large are the qualities of
  sending everything to one tier: the share of the gap between the tiers that routing recovers;
- APGR = the integral of PGR over c from 0 to 1 (RouteLLM approximates it with the trapezoid rule over
  10 threshold deciles; we use every threshold, n + 1 points). Random routing recovers the gap linearly
  (expected PGR(c) = c), so its APGR is 0.5;
- CPT(x%) = the smallest share of large-tier calls at which PGR reaches x% (linear between points).
Ties in the score move together: a threshold cannot split them, and the line between the two sides
of a tie is exactly the expected quality of breaking it at random.
The metrics assume q_large > q_small; where the tiers tie they are undefined (NaN).

The baselines: random routing (its expected curve), a prompt-length heuristic (longest prompts go large)
and the optimal router (an oracle that knows the labels), the ceiling any router can reach.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from router_model.examples import Example
from router_model.features import prompt_chars


@dataclass(frozen=True)
class Curve:
    """Quality at each large-tier share reachable by some threshold, shares ascending from 0 to 1."""

    shares: np.ndarray
    quality: np.ndarray


@dataclass(frozen=True)
class CurveMetrics:
    apgr: float
    cpt50: float  # a share of calls, 0-1
    cpt80: float


@dataclass
class Evaluation:
    n: int
    q_small: float
    q_large: float
    curves: dict[str, Curve] = field(default_factory=dict)
    metrics: dict[str, CurveMetrics] = field(default_factory=dict)


def auc(labels: Sequence[bool] | np.ndarray, scores: Sequence[float] | np.ndarray) -> float:
    """ROC AUC of `scores` for `labels` (scikit-learn's); NaN where the labels are all one class."""
    from sklearn.metrics import roc_auc_score

    y = np.asarray(labels, dtype=bool)
    return float(roc_auc_score(y, np.asarray(scores))) if 0 < int(y.sum()) < len(y) else math.nan


def quality_curve(scores: np.ndarray, small_ok: np.ndarray, large_ok: np.ndarray) -> Curve:
    """Route the k lowest-scored prompts large, for every k between tie groups."""
    scores, small_ok, large_ok = np.asarray(scores, float), np.asarray(small_ok, bool), np.asarray(large_ok, bool)
    n = len(scores)
    if n == 0:
        raise ValueError("no prompts to evaluate")
    order = np.argsort(scores, kind="stable")
    s, gain = scores[order], large_ok[order].astype(float) - small_ok[order].astype(float)
    # quality with the first k routed large = q_small + (sum of the first k gains) / n
    quality = (small_ok.sum() + np.concatenate([[0.0], np.cumsum(gain)])) / n
    ks = np.arange(n + 1)
    # a threshold stops only where the next score differs (or at either end)
    keep = np.concatenate([[True], s[1:] != s[:-1], [True]])
    return Curve(shares=ks[keep] / n, quality=quality[keep])


def random_curve(small_ok: np.ndarray, large_ok: np.ndarray) -> Curve:
    """Random routing's expected curve: a straight line from all-small to all-large."""
    return Curve(np.array([0.0, 1.0]), np.array([np.mean(small_ok), np.mean(large_ok)], float))


def pgr(quality: np.ndarray | float, q_small: float, q_large: float) -> np.ndarray:
    gap = q_large - q_small
    if gap == 0:
        return np.full(np.shape(quality), np.nan)
    return (np.asarray(quality, float) - q_small) / gap


def apgr(curve: Curve, q_small: float, q_large: float) -> float:
    """The area under PGR over the large-tier share, 0 to 1 (trapezoid rule over every threshold)."""
    values = pgr(curve.quality, q_small, q_large)
    return float(np.sum((values[1:] + values[:-1]) / 2 * np.diff(curve.shares)))


def bootstrap_apgr(
    p_small_ok: np.ndarray,
    examples: Sequence[Example],
    *,
    rounds: int = 1000,
    seed: int = 0,
    minus: np.ndarray | None = None,
    level: float = 0.95,
) -> tuple[float, float]:
    """A percentile bootstrap interval of APGR over `examples` (resampled with replacement, q_small and
    q_large taken on each resample). `minus`: another router's scores on the same examples; the interval
    is then of the difference (paired: both scored on the same resamples). Resamples where the tiers
    tie are skipped; (nan, nan) if every one does."""
    small = np.array([e.small_ok for e in examples], bool)
    large = np.array([e.large_ok for e in examples], bool)
    p = np.asarray(p_small_ok, float)
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(rounds):
        idx = rng.integers(0, len(p), len(p))
        qs, ql = small[idx].mean(), large[idx].mean()
        if qs == ql:
            continue
        value = apgr(quality_curve(p[idx], small[idx], large[idx]), qs, ql)
        if minus is not None:
            value -= apgr(quality_curve(np.asarray(minus, float)[idx], small[idx], large[idx]), qs, ql)
        values.append(value)
    if not values:
        return math.nan, math.nan
    tail = (1 - level) / 2 * 100
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))


def cpt(curve: Curve, q_small: float, q_large: float, target: float) -> float:
    """The smallest large-tier share at which PGR reaches `target` (e.g. 0.5), on the piecewise-linear curve."""
    values = pgr(curve.quality, q_small, q_large)
    if np.isnan(values).any():
        return math.nan
    if values[0] >= target:
        return 0.0
    for i in range(1, len(values)):
        if values[i] >= target:
            lo, hi = values[i - 1], values[i]
            frac = (target - lo) / (hi - lo)
            return float(curve.shares[i - 1] + frac * (curve.shares[i] - curve.shares[i - 1]))
    return math.nan  # not reached: only possible for a target above 1


def curve_metrics(curve: Curve, q_small: float, q_large: float) -> CurveMetrics:
    return CurveMetrics(
        apgr=apgr(curve, q_small, q_large),
        cpt50=cpt(curve, q_small, q_large, 0.5),
        cpt80=cpt(curve, q_small, q_large, 0.8),
    )


def evaluate_scores(
    scores: dict[str, np.ndarray], small_ok: Sequence[bool], large_ok: Sequence[bool], *, baselines: bool = True
) -> Evaluation:
    """Curves and metrics for each named score (higher = small more likely fine), plus random and optimal."""
    small, large = np.asarray(small_ok, bool), np.asarray(large_ok, bool)
    result = Evaluation(n=len(small), q_small=float(small.mean()), q_large=float(large.mean()))
    curves = {name: quality_curve(s, small, large) for name, s in scores.items()}
    if baselines:
        curves["random"] = random_curve(small, large)
        # the oracle routes large first where only large succeeds, last where only small does
        curves["optimal"] = quality_curve(small.astype(float) - large.astype(float), small, large)
    for name, curve in curves.items():
        result.curves[name] = curve
        result.metrics[name] = curve_metrics(curve, result.q_small, result.q_large)
    return result


def evaluate_router(p_small_ok: np.ndarray, examples: Sequence[Example]) -> Evaluation:
    """The router's curve against random, the length heuristic and the optimal router."""
    lengths = np.array([prompt_chars(e.messages) for e in examples], float)
    return evaluate_scores(
        {"router": np.asarray(p_small_ok, float), "length": -lengths},
        [e.small_ok for e in examples],
        [e.large_ok for e in examples],
    )


def operating_point(p_small_ok: np.ndarray, examples: Sequence[Example], threshold: float) -> tuple[float, float]:
    """(share of large-tier calls, quality) of routing these examples at `threshold`."""
    large = np.asarray(p_small_ok, float) < threshold
    ok = [e.large_ok if go_large else e.small_ok for e, go_large in zip(examples, large, strict=True)]
    return float(large.mean()), float(np.mean(ok))


def format_table(evaluation: Evaluation) -> str:
    """One line per method: APGR, CPT(50%), CPT(80%)."""
    e = evaluation
    lines = [
        f"{e.n} held-out prompts; quality all-small {e.q_small:.3f}, all-large {e.q_large:.3f}",
        f"{'method':<10} {'APGR':>7} {'CPT(50%)':>9} {'CPT(80%)':>9}",
    ]
    for name, m in evaluation.metrics.items():
        lines.append(f"{name:<10} {m.apgr:>7.3f} {_pct(m.cpt50):>9} {_pct(m.cpt80):>9}")
    return "\n".join(lines)


def _pct(share: float) -> str:
    return "n/a" if math.isnan(share) else f"{100 * share:.1f}%"


def plot_curves(evaluation: Evaluation, path: Path, title: str = "Router: quality against large-tier calls") -> Path:
    """A PNG of quality against the share of large-tier calls for every method, the two tiers as lines."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"random": (":", "tab:green"), "optimal": ("--", "black")}
    for name, curve in evaluation.curves.items():
        style, color = styles.get(name, ("-", None))
        label = f"{name} (APGR {evaluation.metrics[name].apgr:.2f})"
        ax.plot(100 * curve.shares, curve.quality, style, color=color, label=label)
    ax.axhline(evaluation.q_small, color="grey", linestyle="-.", linewidth=0.8, label="all small")
    ax.axhline(evaluation.q_large, color="red", linestyle="-.", linewidth=0.8, label="all large")
    ax.set_xlabel("large-tier calls (%)")
    ax.set_ylabel("prompts answered acceptably")
    ax.set_title(f"{title} (n={evaluation.n})")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def metrics_json(evaluation: Evaluation) -> dict[str, float | int | None]:
    """The headline numbers: the router's APGR and CPTs (shares of calls, 0-1) and the baselines' APGR."""

    def num(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 4)

    out: dict[str, float | int | None] = {"n_heldout": evaluation.n, "q_small": num(evaluation.q_small),
                                          "q_large": num(evaluation.q_large)}  # fmt: skip
    if "router" in evaluation.metrics:
        m = evaluation.metrics["router"]
        out |= {"apgr": num(m.apgr), "cpt50": num(m.cpt50), "cpt80": num(m.cpt80)}
    for name, m in evaluation.metrics.items():
        if name != "router":
            out[f"apgr_{name}"] = num(m.apgr)
    return out
