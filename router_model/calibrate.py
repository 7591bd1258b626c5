"""Thresholds: the one that sends a target share of calls to the large tier, or the one that sends the
fewest while keeping a quality floor; globally or for one tenant, from a list of conversations.

A threshold t routes a conversation large when P(small is good enough) < t. On the calibration
prompts, sorted by that probability, sending the k lowest large is reachable for every k that does not
split a tie; the threshold is the midpoint between the k-th and the (k+1)-th probability, so unseen
prompts near the boundary fall on either side alike. 0 sends nothing large and 1 everything (the
router keeps probabilities inside (0, 1)).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from router_model.evaluate import quality_curve
from router_model.features import Messages

DEFAULT_LARGE_SHARE = 0.25  # policies.policy.RouterSettings.large_share's default
MIN_TENANT_PROMPTS = 100  # fewer and a tenant's own share is mostly noise (±4 points at s = 0.25)


def threshold_for_share(p_small_ok: Sequence[float] | np.ndarray, large_share: float) -> float:
    """The threshold whose share of large-tier calls on these probabilities is closest to `large_share`."""
    if not 0.0 <= large_share <= 1.0:
        raise ValueError(f"large_share must be within [0, 1], not {large_share}")
    p = np.sort(np.asarray(p_small_ok, float))
    if len(p) == 0:
        raise ValueError("no prompts to calibrate on")
    ks = _reachable(p)
    k = int(ks[np.argmin(np.abs(ks / len(p) - large_share))])
    return _threshold_at(p, k)


def threshold_for_quality_floor(
    p_small_ok: Sequence[float] | np.ndarray, small_ok: Sequence[bool], large_ok: Sequence[bool], min_quality: float
) -> float:
    """The threshold with the fewest large-tier calls whose quality (labels known) is at least `min_quality`.

    Where no share reaches the floor, the one with the best quality."""
    p = np.asarray(p_small_ok, float)
    curve = quality_curve(p, np.asarray(small_ok, bool), np.asarray(large_ok, bool))
    meets = np.flatnonzero(curve.quality >= min_quality - 1e-12)
    i = int(meets[0]) if len(meets) else int(np.argmax(curve.quality))
    return _threshold_at(np.sort(p), round(curve.shares[i] * len(p)))


def threshold_for_ladder_floor(
    p_small_ok: Sequence[float] | np.ndarray,
    small_ok: Sequence[bool],
    large_ok: Sequence[bool],
    min_quality: float,
    p_tiny_ok: Sequence[float] | np.ndarray,
    tiny_ok: Sequence[bool | None],
) -> tuple[float, float]:
    """The lowest (cheapest) threshold whose three-tier routing keeps `min_quality` on these prompts, and
    the share it sends large: each prompt goes tiny where P(tiny ok) reaches the threshold, else small
    where P(small ok) does, else large (`router_model.model.cheapest_tier`), and scores its tier's verdict
    (a prompt without a tiny verdict counts as tiny being wrong). Where no threshold reaches the floor,
    the one with the best quality. The threshold is the midpoint between the chosen probability and the
    next lower one, so unseen prompts near it fall on either side alike."""
    p_small, p_tiny = np.asarray(p_small_ok, float), np.asarray(p_tiny_ok, float)
    ok_small, ok_large = np.asarray(small_ok, bool), np.asarray(large_ok, bool)
    ok_tiny = np.array([bool(v) for v in tiny_ok], bool)
    if len(p_small) == 0:
        raise ValueError("no prompts to calibrate on")
    values = np.unique(np.concatenate([p_small, p_tiny, [0.0]]))
    candidates = np.concatenate([values, [1.0 + 1e-9]])  # >= each probability, and above all of them
    tiny = p_tiny[None, :] >= candidates[:, None]
    small = ~tiny & (p_small[None, :] >= candidates[:, None])
    quality = np.where(tiny, ok_tiny, np.where(small, ok_small, ok_large)).mean(axis=1)
    meets = np.flatnonzero(quality >= min_quality - 1e-12)
    i = int(meets[0]) if len(meets) else int(np.argmax(quality))
    threshold = (
        1.0 if i == len(candidates) - 1 else float(candidates[i] if i == 0 else (candidates[i - 1] + candidates[i]) / 2)
    )
    large = ~(p_tiny >= threshold) & ~(p_small >= threshold)
    return threshold, float(large.mean())


def large_share(p_small_ok: Sequence[float] | np.ndarray, threshold: float) -> float:
    """The share of these conversations that `threshold` sends to the large tier."""
    return float(np.mean(np.asarray(p_small_ok, float) < threshold))


def calibrate(router: object, conversations: Sequence[Messages], target_share: float) -> float:
    """The global threshold for `target_share` on these conversations (a `router_model.model.Router`)."""
    return threshold_for_share(router.p_small_ok(conversations), target_share)  # type: ignore[attr-defined]


def calibrate_tenants(
    router: object,
    conversations_by_tenant: Mapping[str, Sequence[Messages]],
    target_share: float,
    min_prompts: int = MIN_TENANT_PROMPTS,
) -> dict[str, float]:
    """Each tenant's threshold for `target_share` on its own logged conversations; tenants with fewer than
    `min_prompts` are left out (they keep the global threshold)."""
    return {
        tenant: calibrate(router, conversations, target_share)
        for tenant, conversations in conversations_by_tenant.items()
        if len(conversations) >= min_prompts
    }


def read_conversations(path: Path) -> list[Messages]:
    """Conversations from a JSONL file, one a line: {"messages": [...]} (a request body) or the list itself."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
            messages = row.get("messages") if isinstance(row, dict) else row
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise ValueError(f"{path}:{n}: no list of messages")
            out.append(messages)
    return out


def _reachable(sorted_p: np.ndarray) -> np.ndarray:
    """Every k such that "the k lowest go large" does not split a tie."""
    n = len(sorted_p)
    inner = np.flatnonzero(sorted_p[1:] != sorted_p[:-1]) + 1
    return np.concatenate([[0], inner, [n]])


def _threshold_at(sorted_p: np.ndarray, k: int) -> float:
    if k <= 0:
        return 0.0
    if k >= len(sorted_p):
        return 1.0
    return float((sorted_p[k - 1] + sorted_p[k]) / 2)
