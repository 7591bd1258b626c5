"""A quality floor as a threshold on a router's held-out curve, kept on every group of prompts the curve can check.

The floor is `ratio` × always-large's quality. Over all held-out prompts it can hold by overpaying nowhere and
underpaying somewhere: tool requests borrowing quality from text, or tool requests that need no call (where the
tiny tier, which never calls, is always right and the large one, which calls, is nearly always wrong) paying for
the ones that need a call (where tiny is never right). So a request's threshold holds the floor on its kind's
held-out prompts (`router_model.kinds`), and also on each finer group of that kind the labels mark
(`Example.needs_call`: tools/call, tools/none) with at least `MIN_KIND_HELDOUT` prompts: the highest of their
cheapest thresholds.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MIN_KIND_HELDOUT", "floor_threshold"]

# Held-out prompts of a kind (or group) before its own curve sets its threshold and the kind counts as known: at 20
# one answer is 5 points of quality; fewer and the floor could not be checked on it at all.
MIN_KIND_HELDOUT = 20


def floor_threshold(curve: dict, ratio: float, tiny: bool, kind: str | None) -> tuple[float, float] | None:
    """(threshold, the share of `kind`'s held-out prompts it sends large) on a router's held-out curve; `kind`
    None: over the whole curve. None where the kind has fewer than MIN_KIND_HELDOUT prompts there."""
    p = np.asarray(curve["p"], float)
    rows = np.ones(len(p), bool) if kind is None else np.asarray(curve["kind"]) == kind
    if kind is not None and rows.sum() < MIN_KIND_HELDOUT:
        return None
    groups = [rows]
    if kind is not None and curve.get("group"):
        group = np.asarray(curve["group"])
        for name in sorted(set(group[rows])):
            if name != kind and (found := rows & (group == name)).sum() >= MIN_KIND_HELDOUT:
                groups.append(found)
    threshold = max(_cheapest(curve, ratio, tiny, g) for g in groups)
    large = p[rows] < threshold
    if tiny:
        large &= np.asarray(curve["p_tiny"], float)[rows] < threshold
    return threshold, float(large.mean())


def _cheapest(curve: dict, ratio: float, tiny: bool, rows: np.ndarray) -> float:
    from router_model.calibrate import threshold_for_ladder_floor, threshold_for_quality_floor

    p = np.asarray(curve["p"], float)[rows]
    small_ok = np.asarray(curve["small_ok"], bool)[rows]
    large_ok = np.asarray(curve["large_ok"], bool)[rows]
    target = ratio * float(large_ok.mean())
    if tiny:
        p_tiny = np.asarray(curve["p_tiny"], float)[rows]
        tiny_ok = [v for v, r in zip(curve["tiny_ok"], rows, strict=True) if r]
        return threshold_for_ladder_floor(p, small_ok, large_ok, target, p_tiny, tiny_ok)[0]
    return threshold_for_quality_floor(p, small_ok, large_ok, target)
