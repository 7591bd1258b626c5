"""Console pages for admin keys: tenants and their keys, a tenant's policy (edit, roll back) and policy
tuning's proposals (read, apply, reject)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import anyio
from fastapi import Path as PathParam
from fastapi import Request, Response
from sqlalchemy.exc import IntegrityError

from core.db.database import Database
from core.db.models import Tenant
from gateway.accounting.tenants import (
    ROLES,
    OperatorOnly,
    Principal,
    TenantError,
    create_key,
    create_tenant,
    list_keys,
    list_tenants,
    revoke_key,
)
from gateway.api.deps import DatabaseDep, PipelineDep, PolicyStoreDep, ProposalStoreDep
from gateway.console.render import AdminTenant, changes, page, redirect, router, tenant_url
from gateway.console.session import AdminUser, Posted, small_int
from gateway.http.errors import APIError
from gateway.pipeline import Pipeline
from gateway.pipeline.policy_check import invalid_policy
from policies.proposals import ProposalError, ProposalStore
from policies.store import PolicyError, PolicyStore

# --- tenants and keys ----------------------------------------------------------------------------------


async def _tenants_page(
    request: Request, db: Database, principal: Principal, status: int = 200, **context: Any
) -> Response:
    only = principal.scope
    rows = await anyio.to_thread.run_sync(list_tenants, db, only)
    return page(request, "tenants.html", status, tenants=rows, **context)


@router.get("/tenants")
async def tenants(request: Request, db: DatabaseDep, principal: AdminUser) -> Response:
    return await _tenants_page(request, db, principal)


@router.post("/tenants")
async def new_tenant(request: Request, db: DatabaseDep, principal: AdminUser, form: Posted) -> Response:
    name, operator = form.get("name", "").strip(), form.get("operator") == "on"
    try:
        issued = await anyio.to_thread.run_sync(
            lambda: create_tenant(db, name, operator=operator, actor=principal.actor, by=principal)
        )
    except OperatorOnly as exc:
        raise APIError(403, str(exc)) from None
    except TenantError as exc:
        return await _tenants_page(request, db, principal, 422, error=str(exc), name=name)
    # Rendered, not redirected: the new key is shown this once and must not end up in a URL.
    return await _tenants_page(request, db, principal, 201, issued=issued)


async def _tenant_page(request: Request, db: Database, tenant: Tenant, status: int = 200, **context: Any) -> Response:
    keys = await anyio.to_thread.run_sync(list_keys, db, tenant.id)
    revoked = request.query_params.get("revoked")
    if not any(k.prefix == revoked and k.revoked_at is not None for k in keys):
        revoked = None  # only ever echo a prefix that names a key this page lists
    return page(request, "tenant.html", status, tenant=tenant, keys=keys, roles=ROLES, revoked=revoked, **context)


@router.get("/tenants/{name}")
async def tenant(request: Request, db: DatabaseDep, t: AdminTenant) -> Response:
    return await _tenant_page(request, db, t)


@router.post("/tenants/{name}/keys")
async def new_key(request: Request, db: DatabaseDep, principal: AdminUser, form: Posted, t: AdminTenant) -> Response:
    role = form.get("role", "")
    if role not in ROLES:
        return await _tenant_page(request, db, t, 422, error=f"role must be one of {', '.join(ROLES)}")
    issued = await anyio.to_thread.run_sync(lambda: create_key(db, t.name, role, actor=principal.actor))
    return await _tenant_page(request, db, t, 201, issued=issued)


@router.post("/tenants/{name}/keys/revoke")
async def revoke(db: DatabaseDep, principal: AdminUser, form: Posted, t: AdminTenant) -> Response:
    prefix = form.get("prefix", "")
    try:
        await anyio.to_thread.run_sync(lambda: revoke_key(db, prefix, actor=principal.actor, tenant_id=t.id))
    except TenantError as exc:
        raise APIError(404, str(exc)) from None
    return redirect(tenant_url(t.name), revoked=prefix)


# --- policies ------------------------------------------------------------------------------------------


async def _policy_page(
    request: Request,
    store: PolicyStore,
    pipeline: Pipeline,
    tenant: Tenant,
    text: str | None = None,
    status: int = 200,
    **context: Any,
) -> Response:
    current = await anyio.to_thread.run_sync(store.current, tenant.id)
    history = await anyio.to_thread.run_sync(store.history, tenant.id)
    if text is None:
        text = json.dumps(current.policy.model_dump(mode="json"), indent=2)
    return page(
        request,
        "policy.html",
        status,
        tenant=tenant,
        current=current,
        history=history,
        text=text,
        served=list(pipeline.engines),
        saved=small_int(request.query_params.get("saved")),
        **context,
    )


@router.get("/tenants/{name}/policy")
async def policy(request: Request, store: PolicyStoreDep, pipeline: PipelineDep, t: AdminTenant) -> Response:
    return await _policy_page(request, store, pipeline, t)


@router.post("/tenants/{name}/policy")
async def save_policy(
    request: Request,
    store: PolicyStoreDep,
    pipeline: PipelineDep,
    principal: AdminUser,
    form: Posted,
    t: AdminTenant,
) -> Response:
    text, note = form.get("policy", ""), form.get("note", "").strip()[:200]
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        problem = {"param": f"line {exc.lineno}, column {exc.colno}", "message": exc.msg}
        return await _policy_page(request, store, pipeline, t, text, 422, errors=[problem], note=note)
    if not isinstance(body, dict):
        problems = [{"param": None, "message": "must be a JSON object"}]
        return await _policy_page(request, store, pipeline, t, text, 422, errors=problems)
    try:
        validated = pipeline.served_policy(body)
        if problems := await pipeline.adapters.missing(t.id, validated):
            raise invalid_policy(problems)
    except APIError as exc:
        errors = exc.details or [{"param": exc.param, "message": exc.message}]
        return await _policy_page(request, store, pipeline, t, text, exc.status, errors=errors, note=note)
    try:
        version = await anyio.to_thread.run_sync(lambda: store.save(t.id, validated, principal.actor, note))
    except IntegrityError:
        problem = {"param": None, "message": "The policy changed at the same moment; reload it and retry."}
        return await _policy_page(request, store, pipeline, t, text, 409, errors=[problem], note=note)
    return redirect(tenant_url(t.name, "/policy"), saved=version)


@router.post("/tenants/{name}/policy/rollback")
async def rollback(
    request: Request,
    store: PolicyStoreDep,
    pipeline: PipelineDep,
    principal: AdminUser,
    form: Posted,
    t: AdminTenant,
) -> Response:
    version = small_int(form.get("version"))
    try:
        if version is None:
            raise PolicyError("no version given")
        saved = await anyio.to_thread.run_sync(store.rollback, t.id, version, principal.actor)
    except (PolicyError, IntegrityError) as exc:
        errors = [{"param": "version", "message": str(exc)}]
        return await _policy_page(request, store, pipeline, t, None, 409, errors=errors)
    return redirect(tenant_url(t.name, "/policy"), saved=saved)


# --- tuning proposals ----------------------------------------------------------------------------------


ProposalNumber = Annotated[int, PathParam(ge=1, le=2**31 - 1)]  # a 32-bit column: larger is a 422, not SQL's error


@router.get("/tenants/{name}/policy/proposals")
async def proposals(request: Request, store: ProposalStoreDep, t: AdminTenant) -> Response:
    rows = await anyio.to_thread.run_sync(store.list, t.id)
    return page(request, "proposals.html", tenant=t, proposals=rows)


async def _proposal_page(
    request: Request,
    store: ProposalStore,
    policies: PolicyStore,
    t: Tenant,
    pid: int,
    status: int = 200,
    **context: Any,
) -> Response:
    try:
        p = await anyio.to_thread.run_sync(store.get, t.id, pid)
    except ProposalError as exc:
        raise APIError(404, str(exc)) from None
    base = await anyio.to_thread.run_sync(policies.version, t.id, p.base_version)
    diff = changes(base.policy.model_dump(mode="json"), p.policy, limit=20)
    return page(request, "proposal.html", status, tenant=t, p=p, r=p.report, changes=diff, **context)


@router.get("/tenants/{name}/policy/proposals/{pid}")
async def proposal(
    request: Request, pid: ProposalNumber, store: ProposalStoreDep, policies: PolicyStoreDep, t: AdminTenant
) -> Response:
    return await _proposal_page(request, store, policies, t, pid)


@router.get("/tenants/{name}/policy/proposals/{pid}/plot.png")
async def proposal_plot(pid: ProposalNumber, store: ProposalStoreDep, t: AdminTenant) -> Response:
    try:
        png = await anyio.to_thread.run_sync(store.plot, t.id, pid)
    except ProposalError as exc:
        raise APIError(404, str(exc)) from None
    if png is None:
        raise APIError(404, "This proposal has no plot.")
    return Response(png, media_type="image/png")


@router.post("/tenants/{name}/policy/proposals/{pid}/apply")
async def apply_proposal(
    request: Request,
    pid: ProposalNumber,
    store: ProposalStoreDep,
    policies: PolicyStoreDep,
    principal: AdminUser,
    form: Posted,
    t: AdminTenant,
) -> Response:
    try:
        version = await anyio.to_thread.run_sync(store.apply, t.id, pid, principal.actor)
    except ProposalError as exc:
        if exc.code == "not_found":
            raise APIError(404, str(exc)) from None
        return await _proposal_page(request, store, policies, t, pid, 409, error=str(exc))
    except IntegrityError:
        error = "The policy changed at the same moment; retry."
        return await _proposal_page(request, store, policies, t, pid, 409, error=error)
    return redirect(tenant_url(t.name, "/policy"), saved=version)


@router.post("/tenants/{name}/policy/proposals/{pid}/reject")
async def reject_proposal(
    request: Request,
    pid: ProposalNumber,
    store: ProposalStoreDep,
    policies: PolicyStoreDep,
    principal: AdminUser,
    form: Posted,
    t: AdminTenant,
) -> Response:
    reason = form.get("reason", "").strip()[:200]
    try:
        await anyio.to_thread.run_sync(lambda: store.reject(t.id, pid, principal.actor, reason))
    except ProposalError as exc:
        if exc.code == "not_found":
            raise APIError(404, str(exc)) from None
        return await _proposal_page(request, store, policies, t, pid, 409, error=str(exc))
    return redirect(tenant_url(t.name, f"/policy/proposals/{pid}"))
