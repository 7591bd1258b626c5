"""The semantic cache's threshold, calibrated on labeled pairs (`data/semantic_pairs.jsonl`: questions that
must and must not share an answer): the lowest threshold, not below `FLOOR`, whose false-hit rate after the
guards and the frame rule is at most 1%. The cache serves the value hard-coded as `DEFAULT_THRESHOLD`;
`calibration_report()` recomputes it (the tests and `bench.semantic_long` do)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from core.embedder import Embedder
from gateway.cache.guard import guard
from gateway.cache.semantic import FLOOR, frame_similarity

__all__ = ["PAIRS", "calibrate", "calibration_report", "load_pairs"]

PAIRS = Path(__file__).parent / "data" / "semantic_pairs.jsonl"


def load_pairs(path: Path = PAIRS) -> list[tuple[str, str, bool]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["a"], r["b"], bool(r["same"])) for r in rows]


def calibrate(
    pairs: list[tuple[str, str, bool]], embedder: Embedder, target_false_hit_rate: float = 0.01, floor: float = FLOOR
) -> tuple[float, dict]:
    """The lowest threshold (not below `floor`) whose false-hit rate (hits on pairs that differ, after the
    guards) is at most the target, and what it gives: the share of equivalent pairs that hit, and the
    false-hit rate."""
    a = embedder.encode([p[0] for p in pairs])
    b = embedder.encode([p[1] for p in pairs])
    sims = (a * b).sum(axis=1)
    # a pair that shares a frame must pass on what differs too: the lower of the two similarities counts
    local = [frame_similarity(embedder, x, y) for x, y, _ in pairs]
    sims = np.array([s if f is None else min(s, f) for s, f in zip(sims, local, strict=True)])
    passes = np.array([guard(x, y) is None for x, y, _ in pairs])
    same = np.array([s for _, _, s in pairs])
    best = 1.0
    for t in sorted({round(float(s), 2) for s in sims} | {1.0}, reverse=True):
        hit = passes & (sims >= t)
        false_rate = float((hit & ~same).sum()) / max(1, int((~same).sum()))
        if false_rate > target_false_hit_rate:
            break
        best = t
    best = max(best, floor)
    hit = passes & (sims >= best)
    report = {
        "threshold": best,
        "pairs": len(pairs),
        "true_hit_rate": float((hit & same).sum()) / max(1, int(same.sum())),
        "false_hit_rate": float((hit & ~same).sum()) / max(1, int((~same).sum())),
        "guard_refusals_on_true_pairs": int((~passes & same).sum()),
    }
    return best, report


def calibration_report(embedder: Embedder | None = None) -> dict:
    """`calibrate` on the shipped pairs, as `DEFAULT_THRESHOLD` was obtained; plus the threshold the pairs
    alone would allow (without the floor)."""
    embedder = embedder or Embedder()
    pairs = load_pairs()
    _, report = calibrate(pairs, embedder)
    report["unfloored_threshold"] = calibrate(pairs, embedder, floor=0.0)[0]
    report["floor"] = FLOOR
    return report
