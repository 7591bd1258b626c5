"""The console's charts, laid out on the server; the templates only draw the shapes computed here.
The finance page's cost chart: per day, a bar for what was paid and one for the always-large
counterfactual. The routing form's curve: quality against the share of requests sent large, with the
operating points marked."""

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


# --- the routing form's curve: quality against the share of requests sent large ---------------------------

CURVE_WIDTH, CURVE_HEIGHT = 720, 300
CURVE_LEFT, CURVE_BOTTOM = 56, 44
MAX_CURVE_POINTS = 400  # a tenant's 5,000 prompts would make a 5,000-vertex line that reads no better


@dataclass(frozen=True)
class Mark:
    kind: str  # "current" or "proposed": the CSS class that draws it
    x: float
    y: float
    label: str
    title: str
    label_x: float  # the label sits above the point in force and below the proposed one, so two close
    label_y: float  # points keep readable labels
    anchor: str  # "start" or "end": away from the plot's right edge


@dataclass
class CurveChart:
    width: int = CURVE_WIDTH
    height: int = CURVE_HEIGHT
    left: int = CURVE_LEFT
    plot_top: int = TOP
    plot_bottom: int = CURVE_HEIGHT - CURVE_BOTTOM
    plot_right: int = CURVE_WIDTH - RIGHT
    line: str = ""  # the curve: an SVG polyline's points
    baseline: str = ""  # random routing: a straight line from all-small to all-large
    marks: list[Mark] = field(default_factory=list)
    y_ticks: list[Label] = field(default_factory=list)
    x_ticks: list[Label] = field(default_factory=list)


def curve_chart(points: list[tuple[float, float]], marks: list[tuple[str, float, float, str]]) -> CurveChart:
    """`points`: (large share, quality), shares ascending from 0 to 1; `marks`: (kind, large share, quality,
    label) for the operating points. Quality's axis spans the data (tenths), not 0-1: the gap between the
    tiers is often a few points, which a 0-1 axis would flatten."""
    chart = CurveChart()
    if not points:
        return chart
    every = math.ceil(len(points) / MAX_CURVE_POINTS)
    shown = points[::every] if points[-1] in points[::every] else [*points[::every], points[-1]]
    ys = [q for _, q in points] + [q for _, _, q, _ in marks]
    lo, hi = math.floor(min(ys) * 10 + 1e-9) / 10, math.ceil(max(ys) * 10 - 1e-9) / 10
    lo, hi = max(0.0, lo), min(1.0, max(hi, lo + 0.1))
    plot_w, plot_h = chart.plot_right - chart.left, chart.plot_bottom - chart.plot_top

    def xy(share: float, quality: float) -> tuple[float, float]:
        return round(chart.left + share * plot_w, 2), round(chart.plot_bottom - (quality - lo) / (hi - lo) * plot_h, 2)

    chart.line = " ".join("{},{}".format(*xy(s, q)) for s, q in shown)
    chart.baseline = " ".join("{},{}".format(*xy(s, q)) for s, q in (points[0], points[-1]))
    for kind, share, quality, label in marks:
        x, y = xy(share, quality)
        title = f"{label}: {share:.0%} of requests large, quality {quality:.3f}"
        anchor, dx = ("end", -10) if x > chart.plot_right - 80 else ("start", 10)
        dy = 18 if kind == "proposed" else -10
        chart.marks.append(Mark(kind, x, y, label, title, x + dx, y + dy, anchor))
    steps = round((hi - lo) * 10)
    every_tick = 1 if steps <= 5 else 2
    for k in range(0, steps + 1, every_tick):
        q = lo + k / 10
        chart.y_ticks.append(Label(chart.left - 6, xy(0, q)[1], f"{q:.1f}"))
    for k in range(0, 5):
        chart.x_ticks.append(Label(xy(k / 4, lo)[0], chart.plot_bottom + 16, f"{k * 25}%"))
    return chart
