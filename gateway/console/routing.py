"""The routing form (admin keys): a tenant's routing edited as a decision, not as JSON.

The page shows the tiers the policy allows (a box per tier this gateway serves), how `auto` picks the
large tier (a calibrated large share, a fixed threshold, or a quality floor turned into a threshold),
and the router's curve of quality against the share of requests sent large on this tenant's prompts
(`routing_plan.curve_data`), the operating point in force marked on it. Submitting previews: the
operating point in force against the proposed one, on the curve and in numbers, and the dry run's cost
before and after on the tenant's recent requests. Confirming saves exactly what was previewed as a new
policy version (audited as `policy.update`, like the JSON editor), refused if the policy changed since
the preview. Only `allowed_tiers` and `router` change; the JSON editor keeps everything else.

Below the curve, what the gateway learned from the tenant's own verdicts (`routing_learning`), its curve drawn
like the router's, and a reset: a policy version without the learned routing, learning again only from
verdicts that come after (audited as `policy.reset_learning`, as `POST /v1/admin/router/tenants/{tenant}/
learning/reset` does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request, Response
from sqlalchemy.exc import IntegrityError

from core.db.database import Database
from core.db.models import Tenant
from gateway.api.deps import DatabaseDep, PipelineDep, PolicyStoreDep
from gateway.console.chart import curve_chart
from gateway.console.render import AdminTenant, changes, page, redirect, router, tenant_url
from gateway.console.routing_learning import section
from gateway.console.routing_plan import (
    CurveData,
    FormValues,
    Problem,
    RoutingChoice,
    RoutingDryRun,
    curve_data,
    effective_threshold,
    merged,
    price_ratio,
    propose,
    read_choice,
    routed_tiers,
    routing_dry_run,
    threshold_of,
)
from gateway.console.session import AdminUser, Posted, small_int
from gateway.http.errors import APIError
from gateway.pipeline import Pipeline
from policies.policy import Policy
from policies.store import PolicyStore, Versioned
from router_model.curve import CurvePoint, relative_cost


@dataclass(frozen=True)
class Side:
    """One operating point: the policy in force, or the proposed one."""

    tiers: str
    mode: str
    threshold: float | None
    threshold_from: str
    point: CurvePoint | None  # where it lands on the curve's prompts, the allowed tiers considered
    cost: float | None  # relative to sending everything large
    tiers_note: str  # why the point is not at the threshold ("" where it is)


@dataclass(frozen=True)
class Preview:
    current: Side
    proposed: Side
    dry_run: RoutingDryRun
    changes: list[tuple[str, str, str]]
    proposed_json: str  # what confirming saves: `allowed_tiers` and `router`
    base: int  # the version previewed against
    note: str


@dataclass(frozen=True)
class _Context:
    """What every routing page is drawn from."""

    current: Versioned
    data: CurveData | None
    unavailable: str | None  # why there is no curve
    tier_names: list[str]


async def _context(db: Database, store: PolicyStore, pipeline: Pipeline, tenant: Tenant) -> _Context:
    current = await anyio.to_thread.run_sync(store.current, tenant.id)
    home = pipeline.settings.home_dir  # off the event loop: it may score the router's held-out prompts, once
    found = await anyio.to_thread.run_sync(lambda: curve_data(db, pipeline.routing, home, tenant.id))
    served = list(pipeline.engines)
    names = served + [t for t in current.policy.allowed_tiers or () if t not in served]
    data, why = (found, None) if isinstance(found, CurveData) else (None, found)
    return _Context(current, data, why, names)


def _side(ctx: _Context, pipeline: Pipeline, tenant: str, policy: Policy, floor: float | None = None) -> Side:
    threshold, source = threshold_of(pipeline.routing, policy, tenant)
    at, tiers_note = effective_threshold(threshold, routed_tiers(policy, list(pipeline.engines)))
    point = ctx.data.at(at) if ctx.data is not None and at is not None else None
    r = policy.router
    mode = {
        "large_share": f"large share {r.large_share:g}",
        "quality_ratio": f"{r.quality_ratio:g} of always-large's quality",
    }.get(r.mode, f"threshold {r.threshold:.4g}")
    if floor is not None:
        mode += f" (quality floor {floor:g})"
    tiers = "any tier served" if policy.allowed_tiers is None else ", ".join(policy.allowed_tiers)
    cost = relative_cost(point.large_share, price_ratio(policy)) if point is not None else None
    return Side(tiers, mode, threshold, source, point, cost, tiers_note)


async def _page(
    request: Request,
    ctx: _Context,
    pipeline: Pipeline,
    tenant: Tenant,
    values: FormValues | None = None,
    status: int = 200,
    preview: Preview | None = None,
    **context: Any,
) -> Response:
    now = _side(ctx, pipeline, tenant.name, ctx.current.policy)
    marks = [] if now.point is None else [("current", now.point.large_share, now.point.quality, "in force")]
    if preview is not None and preview.proposed.point is not None:
        p = preview.proposed.point
        marks.append(("proposed", p.large_share, p.quality, "proposed"))
    chart = None
    if ctx.data is not None:
        points = [(p.large_share, p.quality) for p in ctx.data.curve().points]
        chart = curve_chart(points, marks)
    if values is None:
        floor = now.point.quality if now.point is not None and ctx.data is not None and ctx.data.labeled else None
        values = FormValues.of(ctx.current.policy, floor)
    return page(
        request,
        "routing.html",
        status,
        tenant=tenant,
        current=ctx.current,
        now=now,
        data=ctx.data,
        unavailable=ctx.unavailable,
        chart=chart,
        tiers=[(t, t in pipeline.engines) for t in ctx.tier_names],
        values=values,
        preview=preview,
        saved=small_int(request.query_params.get("saved")),
        reset=small_int(request.query_params.get("reset")),
        quality=pipeline.routing.floor.summary(tenant.name),
        learning=section(pipeline.routing, tenant.name, ctx.current.policy),
        learned_saved=ctx.current.policy.router.learned is not None,
        **context,
    )


@router.get("/tenants/{name}/policy/routing")
async def routing(
    request: Request, db: DatabaseDep, store: PolicyStoreDep, pipeline: PipelineDep, t: AdminTenant
) -> Response:
    return await _page(request, await _context(db, store, pipeline, t), pipeline, t)


@router.post("/tenants/{name}/policy/routing")
async def routing_preview(
    request: Request,
    db: DatabaseDep,
    store: PolicyStoreDep,
    pipeline: PipelineDep,
    principal: AdminUser,
    form: Posted,
    t: AdminTenant,
) -> Response:
    ctx = await _context(db, store, pipeline, t)
    values = FormValues.posted(form, ctx.tier_names)
    choice, errors = read_choice(values, ctx.tier_names)
    change: dict[str, Any] = {}
    if choice is not None:
        change, errors = propose(ctx.current.policy, choice, ctx.data)
    if not errors:
        try:
            proposed = pipeline.served_policy(merged(ctx.current.policy, change))
        except APIError as exc:
            errors = exc.details or [{"param": exc.param, "message": exc.message}]
    if errors:
        return await _page(request, ctx, pipeline, t, values, 422, errors=errors)
    assert choice is not None
    preview = await _preview(ctx, db, pipeline, t, choice, proposed, change, values.note)
    return await _page(request, ctx, pipeline, t, values, preview=preview)


async def _preview(
    ctx: _Context,
    db: Database,
    pipeline: Pipeline,
    tenant: Tenant,
    choice: RoutingChoice,
    proposed: Policy,
    change: dict[str, Any],
    note: str,
) -> Preview:
    floor = choice.value if choice.mode == "quality_floor" else None
    after = _side(ctx, pipeline, tenant.name, proposed, floor)
    served = list(pipeline.engines)
    dry = await anyio.to_thread.run_sync(lambda: routing_dry_run(db, tenant.id, proposed, after.threshold, served))
    diff = changes(ctx.current.policy.model_dump(mode="json"), proposed.model_dump(mode="json"), limit=20)
    return Preview(
        current=_side(ctx, pipeline, tenant.name, ctx.current.policy),
        proposed=after,
        dry_run=dry,
        changes=diff,
        proposed_json=json.dumps(change, separators=(",", ":")),
        base=ctx.current.version,
        note=note,
    )


@router.post("/tenants/{name}/policy/routing/confirm")
async def routing_confirm(
    request: Request,
    db: DatabaseDep,
    store: PolicyStoreDep,
    pipeline: PipelineDep,
    principal: AdminUser,
    form: Posted,
    t: AdminTenant,
) -> Response:
    ctx = await _context(db, store, pipeline, t)
    note = form.get("note", "").strip()[:200]
    if small_int(form.get("base")) != ctx.current.version:
        why = f"The policy changed since this preview (v{ctx.current.version} is in force now): review it again."
        return await _page(request, ctx, pipeline, t, status=409, errors=[{"param": None, "message": why}])
    try:
        change = json.loads(form.get("proposed", ""))
    except json.JSONDecodeError:
        change = None
    if not isinstance(change, dict) or set(change) != {"allowed_tiers", "router"}:
        problem: Problem = {"param": None, "message": "The confirmation names no routing change: preview it again."}
        return await _page(request, ctx, pipeline, t, status=422, errors=[problem])
    try:
        proposed = pipeline.served_policy(merged(ctx.current.policy, change))
    except APIError as exc:
        errors = exc.details or [{"param": exc.param, "message": exc.message}]
        return await _page(request, ctx, pipeline, t, status=exc.status, errors=errors)
    note = note or "routing form"
    try:
        version = await anyio.to_thread.run_sync(lambda: store.save(t.id, proposed, principal.actor, note))
    except IntegrityError:
        why = "The policy changed at the same moment; review it again."
        return await _page(request, ctx, pipeline, t, status=409, errors=[{"param": None, "message": why}])
    return redirect(tenant_url(t.name, "/policy/routing"), saved=version)


@router.post("/tenants/{name}/policy/routing/learning/reset")
async def routing_learning_reset(
    request: Request,
    db: DatabaseDep,
    store: PolicyStoreDep,
    pipeline: PipelineDep,
    principal: AdminUser,
    form: Posted,
    t: AdminTenant,
) -> Response:
    try:
        saved = await pipeline.routing.learning.reset(t.id, principal.actor)
    except IntegrityError:
        ctx = await _context(db, store, pipeline, t)
        why = "The policy changed at the same moment; reset it again."
        return await _page(request, ctx, pipeline, t, status=409, errors=[{"param": None, "message": why}])
    return redirect(tenant_url(t.name, "/policy/routing"), reset=saved.version)
