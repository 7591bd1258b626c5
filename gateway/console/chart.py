"""The finance page's cost chart, laid out on the server: per day, a bar for what was paid and one for
the always-large counterfactual. The template only draws the shapes computed here."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, timedelta
from decimal import Decimal
from typing import Any

WIDTH, HEIGHT = 760, 280
LEFT, RIGHT, TOP, BOTTOM = 72, 16, 16, 44
MAX_FILLED_DAYS = 92  # beyond this, only days with usage get a slot (a year of empty slots reads as nothing)
MAX_X_LABELS = 12
MAX_BAR_WIDTH = 28.0


@dataclass(frozen=True)
class Bar:
    kind: str  # "cost" or "counterfactual": the CSS class that colours it
    x: float
    y: float
    width: float
    height: float
    title: str


@dataclass(frozen=True)
class Label:
    x: float
    y: float
    text: str


@dataclass
class Chart:
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    plot_top: int = TOP
    plot_bottom: int = HEIGHT - BOTTOM
    plot_right: int = WIDTH - RIGHT
    bars: list[Bar] = field(default_factory=list)
    y_ticks: list[Label] = field(default_factory=list)
    x_labels: list[Label] = field(default_factory=list)


def usd(value: Decimal | float | int, digits: int = 4) -> str:
    """Dollars readable at any size: cents from $1 up, else `digits` significant digits (a test
    tenant's day can cost a few millionths of a dollar, which "$0.00" would hide)."""
    v = Decimal(value)
    sign, v = ("-" if v < 0 else ""), abs(v)
    if v == 0 or v >= 1:
        return f"{sign}${v:,.2f}"
    places = min(10, max(2, digits - 1 - math.floor(math.log10(float(v)))))
    whole, _, frac = f"{v:.{places}f}".partition(".")
    return f"{sign}${whole}.{frac.rstrip('0').ljust(2, '0')}"


def by_day(rows: list[dict[str, Any]]) -> dict[date, tuple[Decimal, Decimal]]:
    """(cost, counterfactual) per day, summed over tenants and tiers."""
    sums: dict[date, list[Decimal]] = defaultdict(lambda: [Decimal(0), Decimal(0)])
    for r in rows:
        sums[r["day"]][0] += r["cost"]
        sums[r["day"]][1] += r["counterfactual_cost"]
    return {d: (c, cf) for d, (c, cf) in sorted(sums.items())}


def cost_chart(rows: list[dict[str, Any]]) -> Chart:
    chart = Chart()
    days = by_day(rows)
    if not days:
        return chart
    first, last = min(days), max(days)
    span = (last - first).days + 1
    slots = [first + timedelta(i) for i in range(span)] if span <= MAX_FILLED_DAYS else list(days)
    top = _nice_ceiling(max(float(max(c, cf)) for c, cf in days.values()))
    plot_w = chart.plot_right - chart.left
    plot_h = chart.plot_bottom - chart.plot_top
    slot_w = plot_w / len(slots)
    bar_w = min(MAX_BAR_WIDTH, max(1.0, slot_w * 0.38))
    for i, day in enumerate(slots):
        cost, counterfactual = days.get(day, (Decimal(0), Decimal(0)))
        x0 = chart.left + i * slot_w + (slot_w - 2 * bar_w) / 2  # the pair centred in its day's slot
        for j, (kind, value) in enumerate((("cost", cost), ("counterfactual", counterfactual))):
            # A non-zero day keeps at least a pixel, so it never looks like a day without usage.
            h = 0.0 if value <= 0 else max(1.0, float(value) / top * plot_h)
            what = "cost" if kind == "cost" else "always-large"
            x, y = round(x0 + j * bar_w, 2), round(chart.plot_bottom - h, 2)
            chart.bars.append(Bar(kind, x, y, round(bar_w, 2), round(h, 2), f"{day.isoformat()} {what}: {usd(value)}"))
    every = math.ceil(len(slots) / MAX_X_LABELS)
    for i in range(0, len(slots), every):
        x = chart.left + (i + 0.5) * slot_w
        chart.x_labels.append(Label(round(x, 2), chart.plot_bottom + 16, slots[i].strftime("%m-%d")))
    step = Decimal(repr(top)) / 4
    places = min(10, max(2, -int(step.normalize().as_tuple().exponent)))  # one precision for every tick
    for k in range(5):
        y = chart.plot_bottom - plot_h * k / 4
        chart.y_ticks.append(Label(chart.left - 6, round(y, 2), f"${step * k:,.{places}f}"))
    return chart


def _nice_ceiling(m: float) -> float:
    """The smallest 1, 2, 2.5 or 5 times a power of ten at or above `m`: round axis labels."""
    if m <= 0:
        return 1.0
    exp = math.floor(math.log10(m))
    for step in (1, 2, 2.5, 5, 10):
        if step * 10**exp >= m * (1 - 1e-12):
            return step * 10**exp
    return 10.0 ** (exp + 1)
