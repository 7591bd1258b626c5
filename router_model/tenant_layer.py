"""A tenant's own layer over the shipped router: its verdicts per cell of its prompts, the posterior they give
P(good enough) per tier, and the threshold that keeps its floor on its own mix of prompts.

Verdicts come both ways (`gateway.routing.shadow`: a tiny- or small-served answer re-run on large and judged;
`gateway.routing.explore`: a large-served request also run on the cheaper tiers and judged against large's
answer). Each is counted in its prompt's cell, `kind/region` (`router_model.kinds`, `router_model.regions`;
a `~` marks prompts the shipped labels do not cover), for the tier it judged, under that tier's identity (model,
weights, dtype: a changed tier starts over) and the router's id (regions belong to one router).

    posterior  per tier, a Beta whose prior is the shipped router's P(ok) with weight PRIOR_WEIGHT (0 where the
               labels do not cover the prompt: nothing below large is trusted there before verdicts), updated
               with the cell's (ok, judged): mean (w·p + ok) / (w + n), variance mean·(1 − mean) / (w + n + 1)
    curve      on the tenant's recent routed prompts, for each threshold t: each prompt served by the cheapest
               tier whose posterior mean reaches t, quality = 1 − mean over the prompts of (1 − that mean) (large:
               1, the reference), its variance Σ over (cell, tier) of (share)² · variance; low = quality − 1.96 σ
    threshold  the lowest t whose low end clears the floor plus MARGIN, over the whole mix and over each kind of
               request in it (text, tools: the promise holds per kind, not only on average): the fewest large
               calls the tenant's own verdicts support, never below what the floor's estimate allows

The posterior means are P(as good as large) where the tenant has verdicts and the shipped P(right) where it has
none; the second is the lower (an answer can match a wrong large one), so the mix errs toward large.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np

__all__ = [
    "MARGIN",
    "MIN_FRESH",
    "PRIOR_WEIGHT",
    "Cells",
    "LearnedCurve",
    "LearningVerdicts",
    "Seen",
    "Verdict",
    "cell_of",
    "learn_threshold",
    "posterior",
    "posterior_p_ok",
    "tenant_curve",
]

PRIOR_WEIGHT = 8.0  # the shipped P(ok) counts as 8 verdicts: 10 of a tenant's own outweigh it
MIN_FRESH = 20  # new verdicts before the tenant's threshold is learned again: a version per 20 verdicts at most
MARGIN = 0.01  # the learned routing's 95% low end must clear the floor by this much
Z95 = 1.959964
MAX_CANDIDATES = 200  # thresholds tried along the curve

Cells = Mapping[str, Mapping[str, tuple[int, int]]]  # cell → tier → (good enough, judged)


def cell_of(kind: str, region: int | None, known: bool) -> str:
    """The cell a prompt's verdicts are counted in: kind/region, `~` where the labels do not cover it."""
    return f"{kind}/{'-' if region is None else region}{'' if known else '~'}"


@dataclass(frozen=True)
class Verdict:
    """One judged cheaper answer of a tenant's prompt."""

    tier: str  # the cheaper tier whose answer was judged
    identity: str  # that tier's model, weights and dtype (`router_model.label.tier_model`)
    ok: bool  # as good as the large tier's
    cell: str
    router: str  # the id of the router whose regions `cell` names
    started: float  # epoch seconds
    direction: str  # "shadow": the cheaper tier served it; "explore": large served it
    cost: Decimal = Decimal(0)  # what the run cost at the tenant's prices (operator-paid unless billed)


class LearningVerdicts:
    """Every tenant's verdicts, in order; thread-safe; loaded from the live label log."""

    def __init__(self) -> None:
        self._rows: dict[str, list[Verdict]] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, verdict: Verdict) -> None:
        with self._lock:
            self._rows.setdefault(tenant, []).append(verdict)

    def load(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """The live label rows that carry a cell (`gateway.routing.shadow_rows.label_row`, explore rows too)."""
        for row in rows:
            verdict = verdict_of(row)
            if verdict is not None:
                self.add(str(row["tenant"]), verdict)

    def _matching(self, tenant: str, identities: Mapping[str, str], router: str, since: float) -> list[Verdict]:
        with self._lock:
            rows = list(self._rows.get(tenant, ()))
        return [v for v in rows if v.router == router and identities.get(v.tier) == v.identity and v.started >= since]

    def cells(self, tenant: str, identities: Mapping[str, str], router: str, since: float = 0.0) -> dict:
        """cell → tier → (ok, judged) over the verdicts for these tier identities and this router since `since`."""
        ok: Counter[tuple[str, str]] = Counter()
        judged: Counter[tuple[str, str]] = Counter()
        for v in self._matching(tenant, identities, router, since):
            judged[(v.cell, v.tier)] += 1
            ok[(v.cell, v.tier)] += v.ok
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for (cell, tier), n in judged.items():
            out.setdefault(cell, {})[tier] = (ok[(cell, tier)], n)
        return out

    def count(self, tenant: str, identities: Mapping[str, str], router: str, since: float = 0.0,
              direction: str | None = None) -> int:  # fmt: skip
        return sum(1 for v in self._matching(tenant, identities, router, since)
                   if direction is None or v.direction == direction)  # fmt: skip

    def spend(self, tenant: str) -> dict[str, tuple[int, Decimal]]:
        """direction → (runs, what they cost), over all of the tenant's verdicts."""
        with self._lock:
            rows = list(self._rows.get(tenant, ()))
        out: dict[str, tuple[int, Decimal]] = {}
        for v in rows:
            runs, cost = out.get(v.direction, (0, Decimal(0)))
            out[v.direction] = (runs + 1, cost + v.cost)
        return out


def verdict_of(row: Mapping[str, Any]) -> Verdict | None:
    """The verdict a live label row holds, or None (an older row without a cell, or not a tenant's)."""
    tier = row.get("judged_tier") or row.get("served")
    if row.get("source") != "live" or not isinstance(row.get("tenant"), str) or "cell" not in row:
        return None
    if not isinstance(tier, str) or f"{tier}_ok" not in row:
        return None
    return Verdict(
        tier=tier,
        identity=str(row.get(f"{tier}_model", "")),
        ok=bool(row[f"{tier}_ok"]),
        cell=str(row["cell"]),
        router=str(row.get("router", "")),
        started=float(row.get("started", 0.0)),
        direction=str(row.get("direction", "shadow")),
        cost=Decimal(str(row.get("cost_usd", "0"))),
    )


def posterior(p_router: float, known: bool, ok: int, judged: int) -> tuple[float, float]:
    """(mean, variance) of P(good enough) for one tier in one cell (see the module's docstring)."""
    prior = min(max(p_router, 0.0), 1.0) if known else 0.0
    weight = PRIOR_WEIGHT + judged
    mean = (PRIOR_WEIGHT * prior + ok) / weight
    return mean, mean * (1.0 - mean) / (weight + 1.0)


def posterior_p_ok(p_ok: Mapping[str, float], cell: str, known: bool, cells: Cells) -> dict[str, float]:
    """Each predicted tier's posterior mean for a prompt in `cell` (the router's P where known, else 0, as prior)."""
    counts = cells.get(cell, {})
    return {tier: posterior(p, known, *counts.get(tier, (0, 0)))[0] for tier, p in p_ok.items()}


@dataclass(frozen=True)
class Seen:
    """A routed prompt of the tenant, as the router assessed it (the learning's window)."""

    cell: str
    known: bool
    p_ok: Mapping[str, float]  # the shipped router's P per cheaper tier


@dataclass(frozen=True)
class LearnedCurve:
    threshold: float | None  # None: no threshold short of sending everything large clears the floor
    ratio: float  # estimated quality / always-large's on the window
    low: float  # its 95% lower end
    large_share: float  # the window's share it sends large
    shares: dict[str, float]  # tier → share of the window
    prompts: int
    points: list[tuple[float, float, float]]  # (threshold, large share, ratio) along the curve, for the console


def learn_threshold(
    seen: Sequence[Seen], cells: Cells, floor: float, ladder: Sequence[str], large: str = "large"
) -> LearnedCurve | None:
    """The lowest threshold whose routing of `seen` (cheapest tier of `ladder` first, `large` last) keeps the
    quality's 95% low end at `floor` + MARGIN or above (see the module's docstring); None if none does short of
    sending everything large, or with nothing seen."""
    curve = tenant_curve(seen, cells, floor, ladder, large)
    return curve if curve is not None and curve.threshold is not None else None


def tenant_curve(
    seen: Sequence[Seen], cells: Cells, floor: float, ladder: Sequence[str], large: str = "large"
) -> LearnedCurve | None:
    """The curve along every threshold on `seen` and the one `learn_threshold` picks (None where none clears);
    None with nothing seen or no tier below `large`."""
    cheaper = [t for t in ladder if t != large]
    if not seen or not cheaper:
        return None
    n = len(seen)
    means = np.zeros((len(cheaper), n))
    variances = np.zeros((len(cheaper), n))
    names: dict[str, int] = {}
    keys = np.zeros((len(cheaper), n), dtype=np.int64)  # (cell, tier) group per entry, for the variance
    for j, s in enumerate(seen):
        counts = cells.get(s.cell, {})
        for i, tier in enumerate(cheaper):
            p = s.p_ok.get(tier)
            m, v = posterior(p, s.known, *counts.get(tier, (0, 0))) if p is not None else (0.0, 0.0)
            means[i, j], variances[i, j] = m, v
            keys[i, j] = names.setdefault(f"{s.cell}|{tier}", len(names))
    values = np.unique(means[means > 0])
    if len(values) > MAX_CANDIDATES:  # thresholds between quantiles of the means: fine enough, and fast
        values = np.unique(np.quantile(values, np.linspace(0.0, 1.0, MAX_CANDIDATES)))
    columns = np.arange(n)
    kinds = np.array([s.cell.split("/", 1)[0] for s in seen])
    points: list[tuple[float, float, float]] = []
    best: LearnedCurve | None = None

    def estimate(chosen: np.ndarray, idx: np.ndarray, of: np.ndarray) -> tuple[float, float]:
        """(ratio, 95% low) over the prompts `of` selects."""
        count = int(of.sum())
        lost = float(np.where(chosen & of, 1.0 - means[idx, columns], 0.0).sum())
        group = keys[idx, columns][chosen & of]
        members = np.bincount(group, minlength=len(names))
        summed = np.bincount(group, weights=variances[idx, columns][chosen & of], minlength=len(names))
        ratio = 1.0 - lost / count
        return ratio, ratio - Z95 * math.sqrt(float((members * summed).sum())) / count  # Σ (share)² · mean variance

    for t in [*values, 1.0 + 1e-9]:  # ascending: the first that clears the floor sends the fewest large
        served = np.full(n, -1)
        for i in range(len(cheaper) - 1, -1, -1):  # the cheapest tier that reaches t wins
            served = np.where(means[i] >= t, i, served)
        chosen = served >= 0
        idx = np.where(chosen, served, 0)
        ratio, low = estimate(chosen, idx, np.ones(n, bool))
        # the floor holds per kind of request (text, tools), not only on average
        per_kind = min(estimate(chosen, idx, kinds == k)[1] for k in np.unique(kinds))
        large_share = 1.0 - float(chosen.mean())
        points.append((round(float(t), 4), round(large_share, 4), round(ratio, 4)))
        if best is None and min(low, per_kind) >= floor + MARGIN and large_share < 1.0:
            shares = {tier: float(np.mean(served == i)) for i, tier in enumerate(cheaper)} | {large: large_share}
            best = LearnedCurve(float(t), ratio, low, large_share, shares, n, [])
    step = max(1, len(points) // 40)  # ~40 points are enough to draw
    drawn = points[::step] + points[-1:]
    if best is None:
        last = points[-1]
        return LearnedCurve(None, last[2], last[2], 1.0, {large: 1.0}, n, drawn)
    return LearnedCurve(best.threshold, best.ratio, best.low, best.large_share, best.shares, best.prompts, drawn)
