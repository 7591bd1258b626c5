"""A tuning's evidence for people: a table of every candidate and a PNG of cost against quality."""

from __future__ import annotations

import io
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

PER_THOUSAND = Decimal(1000)


def table(report: Mapping[str, Any]) -> str:
    """The report (`Tuning.as_dict()`) as a text table, the proposal marked with `>`."""
    head = f"{'':2}{'candidate':52} {'tokens':>7} {'$/1k answers':>13} {'quality':>8} {'Δ quality':>10} {'95% CI':>17}"
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        mark = ">" if r["name"] == report["chosen"] else ("" if r["eligible"] else "x")
        ci = f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"
        cost = Decimal(r["cost"]) * PER_THOUSAND
        numbers = f"{r['tokens']:7.1f} {cost:13.4f} {r['quality']:8.3f} {r['delta']:+10.3f} {ci:>17}"
        lines.append(f"{mark:2}{r['name'][:52]:52} {numbers}")
    lines.append(
        f"{report['prompts']} prompts; x: outside the tolerance ({report['tolerance']}) or significantly worse. "
        f"Proposal: {report['chosen']} ({report['token_reduction']:.1%} fewer completion tokens, quality "
        f"{report['quality_delta']:+.3f}, 95% CI [{report['quality_ci'][0]:+.3f}, {report['quality_ci'][1]:+.3f}])"
    )
    return "\n".join(lines)


def plot_png(report: Mapping[str, Any], title: str = "Policy tuning: cost against quality") -> bytes:
    """Each candidate's cost per 1,000 answers against its quality; the current policy and the proposal named."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in report["rows"]:
        cost = float(Decimal(r["cost"]) * PER_THOUSAND)
        chosen, current = r["name"] == report["chosen"], r["name"] == "current"
        color = "tab:green" if chosen else ("black" if current else ("tab:blue" if r["eligible"] else "tab:gray"))
        ax.errorbar(
            cost,
            r["quality"],
            # The change's interval, around this candidate's quality: delta - low below, high - delta above.
            yerr=[[max(0.0, r["delta"] - r["ci_low"])], [max(0.0, r["ci_high"] - r["delta"])]] if not current else None,
            fmt="o",
            color=color,
            alpha=0.9 if (chosen or current) else 0.5,
            capsize=2,
        )
        if chosen or current:
            ax.annotate(r["name"], (cost, r["quality"]), textcoords="offset points", xytext=(6, 6), fontsize=8)
    for color, label in (("black", "current policy"), ("tab:green", "proposal"), ("tab:blue", "qualifies"),
                         ("tab:gray", "loses quality")):  # fmt: skip
        ax.plot([], [], "o", color=color, label=label)
    base = next(r for r in report["rows"] if r["name"] == "current")
    ax.axhline(base["quality"] - report["tolerance"], color="red", linestyle=":", linewidth=0.8, label="tolerance")
    ax.set_xlabel("cost per 1,000 answers (USD)")
    ax.set_ylabel("quality (0-1; bars: 95% CI of the change)")
    ax.set_title(f"{title} (n={report['prompts']})")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()
