"""Admin view of the learned router: which one is loaded, and drift of its large-tier share.

The operator's admin keys see the whole window and every tenant; another tenant's admin key sees its
own tenant's window only.
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter
from pydantic import BaseModel, Field

from gateway.api.auth import AdminPrincipal, visible_tenant
from gateway.api.deps import DatabaseDep, PipelineDep
from gateway.api.params import TenantName
from gateway.http.errors import documented

router = APIRouter(prefix="/v1", tags=["admin"], responses=documented(400, 401, 403, 413, 503))


class TierVerdicts(BaseModel):
    share: float = Field(description="share of the tenant's routed requests (the last 1,000) this tier served")
    ok: int = Field(description="its answers the large tier found good enough")
    judged: int = Field(description="its answers judged")


class QualityEstimate(BaseModel):
    """The tenant's quality under `auto` against always-large, from its own shadow runs (`router_model.quality`)."""

    ratio: float = Field(description="1 - sum over cheaper tiers of share × (1 - ok / judged)")
    low: float = Field(description="95% interval (Wilson's on each tier's ok / judged), lower end")
    high: float = Field(description="upper end")
    judged: int = Field(description="shadow runs judged since the last recalibration (the label log's included)")
    ok: int = Field(description="of them, cheaper answers the large tier found good enough")
    cheaper_share: float = Field(description="share of the window's requests served below large")
    tiers: dict[str, TierVerdicts] = Field(default_factory=dict, description="per cheaper tier")


class Recalibration(BaseModel):
    offset: float = Field(description="how far above the floor the held-out curve is aimed")
    judged: int = Field(description="the tenant's verdicts when it was made (the estimate counts those after)")
    ratio: float = Field(description="the estimate that triggered it")
    high: float = Field(description="its interval's upper end, below the floor")


class Quality(BaseModel):
    """The estimate beside the floor it is held to (`gateway.routing.quality_floor`)."""

    floor: float | None = Field(description="policy mode quality_ratio: the share of always-large's quality promised")
    aimed_at: float | None = Field(description="the floor the held-out curve is aimed at (raised by recalibration)")
    estimate: QualityEstimate | None = Field(description="measured on the tenant's shadow runs; None before one")
    short: bool | None = Field(description="the estimate's upper end is below the floor")
    recalibration: Recalibration | None = Field(description="the last recalibration toward large, if any")


class Spend(BaseModel):
    runs: int = Field(description="runs judged (the label log's included)")
    cost_usd: str = Field(description="what they cost at the tenant's prices, whoever paid (a decimal)")
    share: float | None = Field(None, description="explore: the share of large answers explored now")


class Learning(BaseModel):
    """What the tenant's own verdicts teach its routing (`gateway.routing.learning`)."""

    learn: bool = Field(description="the policy lets its verdicts move its routing")
    active: bool = Field(description="a learned routing applies now (this router, these tiers)")
    threshold: float | None = Field(description="its threshold on the posterior P(good enough)")
    learned: dict[str, Any] | None = Field(description="the learned routing as saved in the policy, its cells left out")
    verdicts: int = Field(description="verdicts for the current tiers and router since the last reset")
    fresh: int = Field(description="of them, those since the last learning")
    cells: dict[str, dict[str, list[int]]] = Field(description="kind/region → tier → [good enough, judged]")
    curve: list[list[float]] = Field(
        description="on the tenant's recent prompts: [threshold, large share, quality ratio]"
    )
    curve_threshold: float | None = Field(description="the threshold a learning now would pick (None: none clears)")
    prompts: int = Field(description="recent routed prompts the curve is estimated on")
    shadow: Spend
    explore: Spend


class Shares(BaseModel):
    decisions: int = Field(description="routing decisions in the window (the last 1,000)")
    large_share: float | None = Field(description="of them, the share sent to the large tier by the router")
    calibrated_large_share: float | None = Field(
        description="the share their thresholds were calibrated to send large (mean over decisions that have one)"
    )
    quality: Quality | None = Field(
        None, description="per tenant: its quality floor and the quality measured on its shadow runs"
    )
    learning: Learning | None = Field(None, description="per tenant: what its own verdicts teach its routing")


class RouterInfo(BaseModel):
    id: str = Field(description="sha256 of the router's model file")
    classifier: str | None
    feature_version: str | None
    created: str | None
    threshold: float = Field(description="the global threshold")
    threshold_from: str | None
    large_share: float | None = Field(description="the share the global threshold sent large where it was calibrated")
    features: str = Field("text", description="hidden: decides on the small tier's hidden state; text: on the text")
    hidden: dict[str, str | int] | None = Field(None, description="the hidden state it reads: tier, model, layer, dim")
    predicts: list[str] = Field(default_factory=list, description="the tiers whose success it predicts")


class RouterStats(BaseModel):
    loaded: bool
    reason: str | None = Field(None, description="why `auto` is unavailable, when no router is loaded")
    router: RouterInfo | None = None
    drift: Shares | None = Field(None, description="every tenant's decisions (the operator's keys only)")
    tenants: dict[str, Shares] = Field(description="per tenant name")
    hidden_states: dict[str, int] | None = Field(
        None, description="routing decisions by where they came from: used (the hidden state) or why the text router "
        "decided instead (busy, timeout, down, failed, other_model, not_local)",
    )  # fmt: skip


@router.get("/admin/router", response_model=RouterStats)
async def router_stats(pipeline: PipelineDep, principal: AdminPrincipal) -> RouterStats:
    """The loaded router and its drift: large-tier share over the last decisions against the calibrated share."""
    visible = None if principal.operator else {principal.tenant_name}
    return RouterStats.model_validate(pipeline.routing.stats(visible))


class LearningReset(BaseModel):
    tenant: str
    version: int = Field(description="the policy version that holds the reset")
    learn_since: float = Field(description="epoch seconds: verdicts from before are not learned from again")


@router.post("/admin/router/tenants/{tenant}/learning/reset", response_model=LearningReset, responses=documented(404))
async def reset_learning(
    tenant: TenantName, db: DatabaseDep, pipeline: PipelineDep, principal: AdminPrincipal
) -> LearningReset:
    """Forget what the tenant's own verdicts taught its routing: a new policy version (audited as
    `policy.reset_learning`) without the learned routing, learning again only from verdicts that come after."""
    found = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    saved = await pipeline.routing.learning.reset(found.id, principal.actor)
    return LearningReset(tenant=found.name, version=saved.version, learn_since=saved.policy.router.learn_since)
