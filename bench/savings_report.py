"""`bench.savings`' report: the router's held-out threshold sweep as cost against accuracy, each tenant's
threshold, the tables per run and tenant, and the PNG.

The sweep (`heldout_sweep`) is the router's held-out curve: the prompts of its label file it was not
trained on (`router_model.train.heldout_examples`), scored by the router, every threshold from all-small to
all-large (`router_model.curve.routing_curve`); a point's cost is what its routing would pay relative to
always-large, from each prompt's token counts in the label file (a row without them: 100 prompt and 200
completion tokens) at the default prices. The run's points are measured on the trace, so they sit on
another population than the curve: the plot shows where the run landed next to what the router promised.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np

from bench.savings_grade import LEVERS
from bench.savings_trace import Request


@dataclass(frozen=True)
class Sweep:
    thresholds: np.ndarray
    cost: np.ndarray  # relative to always-large
    accuracy: np.ndarray
    p: np.ndarray  # the held-out prompts' P(small is good enough)
    small_ok: np.ndarray
    large_ok: np.ndarray
    small_cost: np.ndarray
    large_cost: np.ndarray

    def at(self, threshold: float) -> tuple[float, float]:
        """(relative cost, accuracy) of routing the held-out prompts at `threshold`."""
        large = self.p < threshold
        cost = float(np.where(large, self.large_cost, self.small_cost).sum() / self.large_cost.sum())
        return cost, float(np.where(large, self.large_ok, self.small_ok).mean())


def heldout_sweep(router_dir: Path, home: Path) -> Sweep | None:
    """The router's held-out sweep, or None where its label file is gone or it left nothing out."""
    from policies.policy import PER_MILLION, Policy
    from router_model.curve import routing_curve
    from router_model.examples import load_examples, read_label_rows
    from router_model.model import read_metadata
    from router_model.train import heldout_examples

    meta = read_metadata(router_dir)
    labels = Path(str(meta.get("label_file", "")))
    if not labels.is_file():
        return None
    examples = heldout_examples(load_examples(labels, home), meta)
    if not examples:
        return None
    rows = {str(r["id"]): r for r in read_label_rows(labels)}
    p = served_p_small_ok(router_dir, [e.messages for e in examples], home)
    prices = Policy().prices

    def cost(e: Any, tier: str) -> float:
        row, price = rows[e.id], prices[tier]
        paid = row.get("prompt_tokens", 100) * price.prompt + row.get(f"{tier}_tokens", 200) * price.completion
        return float(paid / PER_MILLION)

    small_ok = np.array([e.small_ok for e in examples], float)
    large_ok = np.array([e.large_ok for e in examples], float)
    small_cost, large_cost = (np.array([cost(e, tier) for e in examples]) for tier in ("small", "large"))
    empty = np.zeros(0)
    sweep = Sweep(empty, empty, empty, np.asarray(p, float), small_ok, large_ok, small_cost, large_cost)
    points = routing_curve(p, small_ok, large_ok).points
    at = [sweep.at(pt.threshold) for pt in points]
    thresholds, cost_at, accuracy = (
        np.array(x, float) for x in ([pt.threshold for pt in points], *zip(*at, strict=True))
    )
    return replace(sweep, thresholds=thresholds, cost=cost_at, accuracy=accuracy)


def router_figures(router_dir: Path) -> dict[str, float | None]:
    """APGR and the low end of its confidence interval from the router's metadata (None where absent)."""
    from router_model.model import read_metadata

    meta = read_metadata(router_dir)
    held = meta.get("heldout_eval") or {}

    def low(d: dict) -> float | None:
        ci = d.get("apgr_ci")
        return d.get("apgr_ci_low", ci[0] if isinstance(ci, list | tuple) and ci else None)

    return {"apgr": held.get("apgr"), "apgr_ci_low": low(held) if low(held) is not None else low(meta)}


def served_p_small_ok(router_dir: Path, conversations: Sequence[Any], home: Path) -> np.ndarray:
    """P(small is good enough) as the gateway computes it: from the small tier's hidden state where the
    router reads one (computed here on that tier, feature cache under `home`), else from the text."""
    from core.settings import Settings
    from gateway.runtime.tiers import load_tier_engine
    from router_model.hidden import FEATURES_DIR, conversation_states
    from router_model.model import load_router

    router = load_router(router_dir)
    spec = router.hidden_spec
    if spec is None:
        return router.p_small_ok(list(conversations))
    settings = Settings(home=home, profile="default")
    engine = load_tier_engine(settings, "small")
    states = conversation_states(engine, list(conversations), spec, settings.home_dir / FEATURES_DIR)
    return np.array([router.p_ok(m, s)["small"] for m, s in zip(conversations, states, strict=True)])


def calibrate(router_dir: Path, trace: Sequence[Request], shares: dict[str, float], home: Path) -> dict[str, float]:
    """Each tenant's threshold: the one that sends its target share of the trace's distinct prompts large
    (as `switchboard router calibrate --tenant` does on a tenant's routed prompts; no labels are used)."""
    from router_model.calibrate import threshold_for_share

    distinct = {r.question: r.messages for r in trace if r.kind == "original"}
    p = served_p_small_ok(router_dir, list(distinct.values()), home)
    return {role: float(threshold_for_share(p, share)) for role, share in shares.items()}


# --- summaries -----------------------------------------------------------------------------------------


def summarize(
    trace: Sequence[Request], results: list[dict], grades: list, finance: Sequence[dict], roles: set[str]
) -> dict[str, Any]:
    """One run (or one tenant of it): accuracy, cost, tiers, cache hits, failures, the saving by lever."""
    mine = [r for r in trace if r.tenant in roles]
    rows = [results[r.index] for r in mine]
    graded = [grades[r.index] for r in mine if grades[r.index] is not None]
    ok = [x for x in rows if x.get("ok")]
    tiers = Counter(x.get("tier") or "?" for x in ok)
    money = {k: sum((Decimal(f[k]) for f in finance), Decimal(0)) for k in ("cost", "counterfactual_cost")}
    saved = {lv: sum((Decimal(f[f"saved_{lv}"]) for f in finance), Decimal(0)) for lv in LEVERS}
    return {
        "requests": len(mine),
        "failed": len(rows) - len(ok),
        "graded": len(graded),
        "accuracy": sum(graded) / len(graded) if graded else None,
        "cost": money["cost"],
        "counterfactual": money["counterfactual_cost"],
        "saved": saved,
        "tiers": {t: n / len(ok) for t, n in sorted(tiers.items())} if ok else {},
        "hit_rate": sum(x.get("cache") in ("hit", "semantic-hit") for x in ok) / len(ok) if ok else 0.0,
        "cascaded": sum(">" in (x.get("cascade") or "") for x in ok),
    }


def ratio(a: float | Decimal | None, b: float | Decimal | None) -> float | None:
    return None if a is None or b is None or not b else round(float(a) / float(b), 4)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def print_table(title: str, summaries: dict[str, dict[str, Any]]) -> None:
    """A markdown table, one row per (run, tenant)."""
    print(f"\n{title}\n")
    print("| run | tenant | requests | failed | accuracy | cost $ | counterfactual $ | tiers | hit rate | cascaded | "
          + " | ".join(f"saved {lv} $" for lv in LEVERS) + " |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---|---:|---:|" + "---:|" * len(LEVERS))
    for label, s in summaries.items():
        run, _, tenant = label.partition("/")
        tiers = ", ".join(f"{t} {share:.0%}" for t, share in s["tiers"].items()) or "-"
        saved = " | ".join(f"{float(s['saved'][lv]):.6f}" for lv in LEVERS)
        print(f"| {run} | {tenant or 'all'} | {s['requests']} | {s['failed']} | {_fmt(s['accuracy'])} "
              f"| {float(s['cost']):.6f} | {float(s['counterfactual']):.6f} | {tiers} | {s['hit_rate']:.3f} "
              f"| {s['cascaded']} | {saved} |")  # fmt: skip


# --- the plot ------------------------------------------------------------------------------------------


def plot(sweep: Sweep | None, thresholds: dict[str, float], measured: dict[str, tuple[float, float]],
         path: Path, title: str) -> Path:  # fmt: skip
    """Accuracy against cost relative to always-large: the router's held-out sweep with each tenant's
    threshold on it, and the run's measured points (always-large at cost 1)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    if sweep is not None:
        ax.plot(sweep.cost, sweep.accuracy, "-", color="tab:blue", label=f"router, held-out sweep (n={len(sweep.p)})")
        for role, t in thresholds.items():
            c, a = sweep.at(t)
            ax.plot([c], [a], "o", mfc="none", color="tab:blue")
            ax.annotate(f"{role} (held-out)", (c, a), textcoords="offset points", xytext=(5, -12), fontsize=8)
        ax.plot([1.0], [sweep.large_ok.mean()], "s", mfc="none", color="red", label="always large (held-out)")
    for label, (c, a) in measured.items():
        large = label.startswith("always large")
        ax.plot([c], [a], "s" if large else "*", color="red" if large else "tab:orange", markersize=10)
        ax.annotate(label, (c, a), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("cost relative to always-large")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
