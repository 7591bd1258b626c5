"""The routing page's "Learned from this tenant's traffic" section (no pages here; `gateway.console.routing` has
them): what the gateway learned from the tenant's own verdicts (`gateway.routing.learning`), read as
`RoutingStage.stats` reads it, but under the policy in force, so that a reset (or a learning saved since the
tenant's last routed request) shows at once; and the learned curve, drawn like the router's.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from gateway.console.chart import CurveChart, curve_chart
from gateway.routing.learning import MIN_SEEN
from gateway.routing.stage import RoutingStage
from policies.policy import Policy
from router_model.tenant_layer import MIN_FRESH


@dataclass(frozen=True)
class Runs:
    """Shadow or explore runs judged for the tenant, and what they cost at its prices (whoever paid)."""

    runs: int
    cost: Decimal
    share: float = 0.0  # explore: of the large answers, the share explored now


@dataclass(frozen=True)
class LearningView:
    active: bool  # the learned routing applies now (learning on, mode quality_ratio, this router, these tiers)
    why: str  # why it does not ("" where it does)
    threshold: float | None  # the learned routing's, on the posterior P(good enough)
    learned: dict[str, Any] | None  # the learned routing as the policy saved it, its cells left out (None: inactive)
    floor: float  # the quality ratio it is held to (`quality_ratio`: the learning does not read the shipped curve)
    verdicts: int  # since the last reset, for the current tiers and router
    fresh: int  # of them, since the last learning
    cells: int  # cells (kind/region) they fall in
    prompts: int  # recent routed prompts the curve is estimated on
    next_threshold: float | None  # what a learning now would pick (None: none clears the floor)
    explore: Runs
    shadow: Runs
    billed: bool  # `router.shadow_billed`: the runs are the tenant's to pay, else the operator's
    chart: CurveChart | None  # the learned curve: quality ratio against the share sent large
    flat: bool  # the curve is at a quality ratio of 1 throughout: nothing to draw

    @property
    def min_prompts(self) -> int:
        """Routed prompts before there is a curve."""
        return MIN_SEEN

    @property
    def clears(self) -> bool | None:
        """Whether the learned routing's 95% low end clears the floor (None: nothing learned)."""
        return None if self.learned is None else self.learned["low"] >= self.floor


def section(routing: RoutingStage, tenant: str, policy: Policy) -> LearningView | str:
    """The section's content, or why there is no learning data yet (one line)."""
    if routing.service is None:
        return "the gateway has no router to learn for"
    found = routing.learning_summary(tenant, policy) if tenant in routing.tenant_drift else None
    return learning_view(found, policy) or "this tenant has had no routed request since the gateway started"


def learning_view(found: dict[str, Any] | None, policy: Policy) -> LearningView | None:
    """The section's content from a learning summary (None: no learning data yet)."""
    if found is None:
        return None
    settings, learned = policy.router, found.get("learned")
    floor = settings.quality_ratio
    points = sorted((float(share), float(ratio)) for _, share, ratio in found.get("curve") or ())
    marks = [] if learned is None else [("current", float(learned["large_share"]), float(learned["ratio"]), "learned")]
    flat = bool(points) and min(q for _, q in points) >= 1.0 - 1e-9  # a 0.0-wide quality axis: nothing to draw
    explore, shadow = found["explore"], found["shadow"]
    return LearningView(
        active=bool(found["active"]),
        why="" if found["active"] else _why_not(policy),
        threshold=found.get("threshold"),
        learned=learned,
        floor=floor,
        verdicts=int(found["verdicts"]),
        fresh=int(found["fresh"]),
        cells=len(found.get("cells") or {}),
        prompts=int(found["prompts"]),
        next_threshold=found.get("curve_threshold"),
        explore=Runs(int(explore["runs"]), Decimal(explore["cost_usd"]), float(explore.get("share", 0.0))),
        shadow=Runs(int(shadow["runs"]), Decimal(shadow["cost_usd"])),
        billed=settings.shadow_billed,
        chart=curve_chart(points, marks) if points and not flat else None,
        flat=flat,
    )


def _why_not(policy: Policy) -> str:
    settings = policy.router
    if not settings.learn:
        return "learning is off for this tenant (router.learn)"
    if settings.mode != "quality_ratio":
        return f"learned routing applies in mode quality_ratio only, and this policy routes by {settings.mode}"
    if settings.learned is not None:
        return "it was learned for another router or other tier models: it waits for verdicts on these"
    return (
        f"nothing learned yet: a learning waits for {MIN_FRESH} fresh verdicts and {MIN_SEEN} routed prompts, "
        "and the first is kept only where it sends fewer requests large than the shipped routing"
    )
