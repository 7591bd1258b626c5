"""The routing form's evidence and arithmetic (no pages here; `gateway.console.routing` has them).

- The curve's prompts (`curve_data`): the tenant's own routed prompts where it has enough stored
  (`router.store_prompts`; each with the P(small is good enough) it was routed on, quality as the router
  predicts it: they have no labels), else the router's held-out labeled prompts (measured quality,
  scored once per router and kept in memory).
- The form's choice (`FormValues`, `read_choice`) and what it changes in the policy (`propose`): only
  `allowed_tiers` and `router`; a new large share is calibrated on the curve's prompts.
- The dry run (`routing_dry_run`): `policies.dry_run.replay` over the tenant's recent ledger rows, with
  each routed request whose probability is stored re-routed at the proposed threshold first.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import func, select

from core.db.database import Database
from core.db.models import RoutedPrompt, Usage
from gateway.routing.stage import AUTO, RoutingStage
from policies.dry_run import DryRun, replay
from policies.policy import Policy, RouterCalibration
from router_model.calibrate import MIN_TENANT_PROMPTS, threshold_for_quality_floor, threshold_for_share
from router_model.curve import CurvePoint, RoutingCurve, operating_point, routing_curve
from router_model.model import LARGE, SMALL, Router
from router_model.routed_prompts import KEEP_PER_TENANT

MODES = ("quality_ratio", "large_share", "threshold", "quality_floor")
DRY_RUN_LIMIT = 500  # the tenant's most recent requests the preview replays (the API's default)
SCORE_CHUNK = 8  # held-out prompts scored per call: live routing decisions interleave with the chunks

Problem = dict[str, str | None]  # {"param", "message"}, as the JSON editor shows them


@dataclass(frozen=True)
class CurveData:
    """The prompts a curve is drawn on: P(small is good enough) and each tier's outcome (labels, or
    probabilities where the quality is the router's own prediction)."""

    p_small_ok: np.ndarray
    small_ok: np.ndarray
    large_ok: np.ndarray
    labeled: bool  # measured labels: a quality floor can be set on them
    source: str  # what the page says the curve is drawn on
    router_id: str

    def curve(self) -> RoutingCurve:
        return routing_curve(self.p_small_ok, self.small_ok, self.large_ok)

    def at(self, threshold: float) -> CurvePoint:
        return operating_point(self.p_small_ok, self.small_ok, self.large_ok, threshold)


_heldout: dict[tuple[str, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
_heldout_lock = threading.Lock()


def curve_data(db: Database, routing: RoutingStage, home: Path, tenant_id: int) -> CurveData | str:
    """The curve's prompts for this tenant, or why there is no curve (blocking: run it in a thread)."""
    if routing.service is None:
        return f"the curve needs the router, and {routing.unavailable}"
    router = routing.service.router
    with db.session() as s:
        stored = list(
            s.scalars(
                select(RoutedPrompt.p_small_ok)
                .where(RoutedPrompt.tenant_id == tenant_id)
                .order_by(RoutedPrompt.id.desc())
                .limit(KEEP_PER_TENANT)
            )
        )
    if len(stored) >= MIN_TENANT_PROMPTS:
        p = np.asarray(stored, float)
        source = (
            f"this tenant's {len(p)} most recent routed prompts, scored when they were routed; no labels, so "
            "quality is the router's prediction (P(small is good enough) where sent small, the large tier "
            "counting as right)"
        )
        return CurveData(p, p, np.ones(len(p)), False, source, router.id)
    try:
        p, small, large = _heldout_scores(router, home)
    except (OSError, ValueError, KeyError) as exc:
        why = exc.args[0] if exc.args else exc
        return f"this tenant has {len(stored)} routed prompts stored (fewer than {MIN_TENANT_PROMPTS}) and {why}"
    source = f"the router's {len(p)} held-out labeled prompts (this tenant has {len(stored)} routed prompts stored)"
    if router.hidden_spec is not None:  # the console has no small-tier prefill of them: the fallback scores
        source += "; scored by the router's text classifier, its fallback, not by the small tier's hidden state"
    return CurveData(p, small, large, True, source, router.id)


def _heldout_scores(router: Router, home: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(P(small is good enough), small_ok, large_ok) on the prompts the router was not trained on."""
    from router_model.examples import load_examples
    from router_model.train import heldout_examples

    label_file = router.metadata.get("label_file")
    if not label_file:
        raise ValueError("the router names no label file to draw its held-out curve from")
    key = (router.id, str(label_file))
    with _heldout_lock:  # scored once per router, by whoever asks first
        if key not in _heldout:
            examples = heldout_examples(load_examples(Path(label_file), home), router.metadata)
            if not examples:
                raise ValueError(f"every prompt in {label_file} trained the router: none is held out")
            chunks = [examples[i : i + SCORE_CHUNK] for i in range(0, len(examples), SCORE_CHUNK)]
            p = np.concatenate([router.p_small_ok([e.messages for e in chunk]) for chunk in chunks])
            small = np.array([e.small_ok for e in examples], float)
            _heldout[key] = (p, small, np.array([e.large_ok for e in examples], float))
        return _heldout[key]


# --- the form ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FormValues:
    """The routing form as shown: from the policy in force, or as the admin typed it."""

    any_tier: bool
    tiers: frozenset[str]
    mode: str
    large_share: str
    threshold: str
    quality_floor: str
    quality_ratio: str = ""
    note: str = ""

    @classmethod
    def of(cls, policy: Policy, quality_floor: float | None) -> FormValues:
        r = policy.router
        return cls(
            any_tier=policy.allowed_tiers is None,
            tiers=frozenset(policy.allowed_tiers or ()),
            mode=r.mode,
            large_share=_num(r.large_share),
            threshold=_num(r.threshold),
            quality_floor="" if quality_floor is None else f"{quality_floor:.3f}",
            quality_ratio=_num(r.quality_ratio),
        )

    @classmethod
    def posted(cls, form: Mapping[str, str], tier_names: list[str]) -> FormValues:
        return cls(
            any_tier=form.get("any_tier") == "on",
            tiers=frozenset(t for t in tier_names if form.get(f"tier:{t}") == "on"),
            mode=form.get("mode", ""),
            large_share=form.get("large_share", "").strip()[:32],
            threshold=form.get("threshold", "").strip()[:32],
            quality_floor=form.get("quality_floor", "").strip()[:32],
            quality_ratio=form.get("quality_ratio", "").strip()[:32],
            note=form.get("note", "").strip()[:200],
        )


@dataclass(frozen=True)
class RoutingChoice:
    tiers: list[str] | None  # None: any tier the gateway serves
    mode: str  # one of MODES
    value: float


def read_choice(values: FormValues, tier_names: list[str]) -> tuple[RoutingChoice | None, list[Problem]]:
    """The admin's choice, or every problem with the form by field."""
    problems: list[Problem] = []
    tiers = None if values.any_tier else [t for t in tier_names if t in values.tiers]
    if tiers == []:
        problems.append({"param": "allowed_tiers", "message": "allow at least one tier (or any tier)"})
    if values.mode not in MODES:
        problems.append({"param": "mode", "message": f"choose one of: {', '.join(MODES)}"})
        return None, problems
    text = getattr(values, values.mode)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:  # NaN fails too
        problems.append({"param": values.mode, "message": f"must be a number from 0 to 1, not {text!r}"})
    return (None if problems else RoutingChoice(tiers, values.mode, value)), problems


def propose(policy: Policy, choice: RoutingChoice, data: CurveData | None) -> tuple[dict[str, Any], list[Problem]]:
    """What the choice changes, as JSON (`allowed_tiers` and `router`), or why it cannot be made. A mode and
    value left as they are leave `router` as it is (its calibration included)."""
    router = policy.router.model_dump(mode="json")
    change: dict[str, Any] = {"allowed_tiers": choice.tiers, "router": router}
    if choice.mode == "quality_floor":
        if data is None or not data.labeled:
            why = "a quality floor needs labeled prompts, and this curve's quality is the router's prediction"
            return change, [{"param": "quality_floor", "message": why if data else "a quality floor needs the curve"}]
        t = threshold_for_quality_floor(data.p_small_ok, data.small_ok > 0.5, data.large_ok > 0.5, choice.value)
        if router["mode"] != "threshold" or router["threshold"] != t:
            router |= {"mode": "threshold", "threshold": t}
    elif choice.mode == "quality_ratio":  # held on the curve as it is, recalibrated on shadow runs: starts afresh
        if router["mode"] != "quality_ratio" or router["quality_ratio"] != choice.value:
            router |= {"mode": "quality_ratio", "quality_ratio": choice.value, "recalibration": None}
    elif choice.mode == "threshold":
        if router["mode"] != "threshold" or router["threshold"] != choice.value:
            router |= {"mode": "threshold", "threshold": choice.value}
    elif router["mode"] != "large_share" or router["large_share"] != choice.value:
        router |= {"mode": "large_share", "large_share": choice.value, "calibration": None}
        if data is not None:
            t = threshold_for_share(data.p_small_ok, choice.value)
            share = float(np.mean(data.p_small_ok < t))
            calibration = RouterCalibration(threshold=t, large_share=share, prompts=len(data.p_small_ok),
                                            router=data.router_id)  # fmt: skip
            router["calibration"] = calibration.model_dump(mode="json")
    return change, []


def merged(policy: Policy, change: Mapping[str, Any]) -> dict[str, Any]:
    """The policy's JSON with `change`'s fields (and only those) replaced."""
    return policy.model_dump(mode="json") | dict(change)


def threshold_of(routing: RoutingStage, policy: Policy, tenant: str) -> tuple[float | None, str]:
    """(the threshold the gateway would route this tenant at under `policy`, where it comes from); None
    where it cannot be known without a router."""
    if routing.service is not None:
        t, source, _ = routing.threshold(policy, tenant)
        names = {"policy": "the policy's own", "tenant": "calibrated for this tenant"}
        names["floor"] = f"held to {policy.router.quality_ratio:g} of always-large's quality on the held-out curve"
        return t, names.get(source, "the router's")
    r = policy.router
    if r.mode == "threshold":
        return r.threshold, "the policy's own"
    if r.calibration is not None:
        return r.calibration.threshold, "calibrated for this tenant, for a router not loaded now"
    return None, "the router's, once one is loaded"


def routed_tiers(policy: Policy, served: list[str]) -> list[str]:
    """The tiers `auto` may send this policy's requests to (`gateway.routing.stage`'s rule)."""
    return [t for t in (SMALL, LARGE) if t in served and policy.allows(t)]


def effective_threshold(threshold: float | None, tiers: list[str]) -> tuple[float | None, str]:
    """The threshold the curve's point is placed at once the allowed tiers had their say, and why it moved:
    with one of the two tiers allowed, `auto` sends everything there."""
    if tiers == [SMALL]:
        return 0.0, f"only {SMALL} is allowed: everything goes there"
    if tiers == [LARGE]:
        return 1.0, f"only {LARGE} is allowed: everything goes there"
    if not tiers:
        return None, f"neither {SMALL} nor {LARGE} is allowed: auto is refused"
    return threshold, ""


def price_ratio(policy: Policy) -> float:
    """What a small-tier token costs against a counterfactual-tier one (prompt and completion prices summed)."""
    small, large = policy.price(SMALL), policy.price(policy.counterfactual_tier)
    whole = large.prompt + large.completion
    return float((small.prompt + small.completion) / whole) if whole else 1.0


def _num(x: float) -> str:
    return f"{x:.4f}".rstrip("0").rstrip(".") if x not in (0.0, 1.0) else str(int(x))


# --- the dry run ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoutingDryRun:
    result: DryRun  # `policies.dry_run.replay` of the re-routed rows under the proposed policy
    to_large: int  # routed requests the proposed threshold sends large that went small
    to_small: int
    unscored: int  # routed requests without a stored probability: replayed on the tier that served them
    threshold: float | None  # None: not known without a router, so nothing was re-routed


def routing_dry_run(
    db: Database, tenant_id: int, policy: Policy, threshold: float | None, served: list[str], limit: int = DRY_RUN_LIMIT
) -> RoutingDryRun:
    """Replay the tenant's `limit` most recent requests under `policy` (blocking). A routed request whose
    P(small is good enough) was stored goes first to the tier the proposed threshold and allowed tiers give
    it, with the same token counts (how many tokens the other tier would have written is not known)."""
    with db.session() as s:
        rows = list(
            s.scalars(select(Usage).where(Usage.tenant_id == tenant_id).order_by(Usage.created_at.desc()).limit(limit))
        )
        routed = [r.request_id for r in rows if r.route == AUTO]
        p = dict(
            s.execute(
                select(RoutedPrompt.request_id, func.min(RoutedPrompt.p_small_ok))
                .where(RoutedPrompt.tenant_id == tenant_id, RoutedPrompt.request_id.in_(routed))
                .group_by(RoutedPrompt.request_id)
            ).all()
        ) if routed else {}  # fmt: skip
    tiers = routed_tiers(policy, served)
    moved = {SMALL: 0, LARGE: 0}
    replayed = []
    for row in rows:
        if row.route == AUTO and row.request_id in p and threshold is not None and tiers:
            choice = SMALL if p[row.request_id] >= threshold else LARGE
            tier = choice if choice in tiers else tiers[0]
            if tier != row.tier:
                moved[tier] += 1
                row = _on_tier(row, tier)
        replayed.append(row)
    unscored = sum(r.route == AUTO and r.request_id not in p for r in rows) if threshold is not None else len(routed)
    return RoutingDryRun(replay(policy, replayed), moved[LARGE], moved[SMALL], unscored, threshold)


def _on_tier(row: Usage, tier: str) -> Usage:
    """A detached copy of the ledger row as if `tier` had served it (nothing drafted: unknown there)."""
    copy = Usage(**{c.key: getattr(row, c.key) for c in Usage.__table__.columns})
    copy.tier, copy.draft_accepted = tier, 0
    return copy
