"""Policy tuning's proposals: read them with their evidence (admin or finance), apply or reject them
(admin). `switchboard policy tune` and the tenant's tuning schedule make them."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Body, Request
from fastapi import Path as PathParam
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import IntegrityError

from gateway.api.auth import AdminPrincipal, PolicyReader, visible_tenant
from gateway.api.deps import DatabaseDep, ProposalStoreDep
from gateway.api.params import TenantName
from gateway.http.errors import APIError, documented
from policies.proposals import Proposal, ProposalError

router = APIRouter(
    prefix="/v1/admin/tenants/{tenant}/policy/proposals",
    tags=["policies"],
    responses=documented(400, 401, 403, 404, 413, 422, 503),
)

ProposalId = Annotated[int, PathParam(ge=1, le=2**31 - 1, description="the proposal's number")]


class ProposalOut(BaseModel):
    id: int
    tenant: str
    status: str = Field(description="proposed | unchanged (the policy in force is the cheapest) | applied | rejected")
    base_version: int = Field(description="the policy version it was tuned from")
    policy: dict[str, Any] = Field(description="the whole proposed policy (the `Policy` schema)")
    report: dict[str, Any] = Field(description="every candidate's tokens, cost, quality and 95% interval")
    plot: str | None = Field(description="where the PNG of cost against quality is")
    created_by: str
    created_at: datetime | None
    decided_by: str | None
    decided_at: datetime | None
    applied_version: int | None


class RejectIn(BaseModel):
    model_config = ConfigDict(strict=True)

    reason: str = Field("", max_length=200)


class Applied(BaseModel):
    proposal: int
    version: int = Field(description="the policy version the proposal became")


def _out(p: Proposal, tenant: str, request: Request) -> ProposalOut:
    plot = request.url_for("proposal_plot", tenant=tenant, proposal=p.id).path if p.has_plot else None
    fields = {k: v for k, v in p.__dict__.items() if k not in ("tenant_id", "has_plot")}
    return ProposalOut(tenant=tenant, plot=plot, **fields)


def _error(exc: ProposalError) -> APIError:
    status = 404 if exc.code == "not_found" else 409
    return APIError(status, str(exc), param="proposal" if status == 404 else None, code=f"proposal_{exc.code}")


@router.get("", response_model=list[ProposalOut])
async def proposals(
    tenant: TenantName, request: Request, db: DatabaseDep, store: ProposalStoreDep, principal: PolicyReader
) -> list[ProposalOut]:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    rows = await anyio.to_thread.run_sync(store.list, t.id)
    return [_out(p, t.name, request) for p in rows]


@router.get("/{proposal}", response_model=ProposalOut)
async def proposal(
    tenant: TenantName,
    proposal: ProposalId,
    request: Request,
    db: DatabaseDep,
    store: ProposalStoreDep,
    principal: PolicyReader,
) -> ProposalOut:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    try:
        p = await anyio.to_thread.run_sync(store.get, t.id, proposal)
    except ProposalError as exc:
        raise _error(exc) from None
    return _out(p, t.name, request)


@router.get("/{proposal}/plot.png", response_class=Response, responses={200: {"content": {"image/png": {}}}})
async def proposal_plot(
    tenant: TenantName, proposal: ProposalId, db: DatabaseDep, store: ProposalStoreDep, principal: PolicyReader
) -> Response:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    try:
        png = await anyio.to_thread.run_sync(store.plot, t.id, proposal)
    except ProposalError as exc:
        raise _error(exc) from None
    if png is None:
        raise APIError(404, f"proposal {proposal} has no plot", param="proposal", code="proposal_not_found")
    return Response(png, media_type="image/png")


@router.post("/{proposal}/apply", response_model=Applied, responses=documented(409))
async def apply(
    tenant: TenantName, proposal: ProposalId, db: DatabaseDep, store: ProposalStoreDep, principal: AdminPrincipal
) -> Applied:
    """Make the proposal the tenant's policy: a new version, audited as `policy.tune`. Refused (409) once
    decided, or when the policy has changed since the proposal was tuned from it."""
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    try:
        version = await anyio.to_thread.run_sync(store.apply, t.id, proposal, principal.actor)
    except ProposalError as exc:
        raise _error(exc) from None
    except IntegrityError:
        raise APIError(409, "The policy changed at the same moment; reload it and retry.", code="conflict") from None
    return Applied(proposal=proposal, version=version)


@router.post("/{proposal}/reject", response_model=ProposalOut, responses=documented(409))
async def reject(
    tenant: TenantName,
    proposal: ProposalId,
    request: Request,
    db: DatabaseDep,
    store: ProposalStoreDep,
    principal: AdminPrincipal,
    body: Annotated[RejectIn | None, Body()] = None,
) -> ProposalOut:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    reason = body.reason if body is not None else ""
    try:
        await anyio.to_thread.run_sync(lambda: store.reject(t.id, proposal, principal.actor, reason))
        p = await anyio.to_thread.run_sync(store.get, t.id, proposal)
    except ProposalError as exc:
        raise _error(exc) from None
    return _out(p, t.name, request)
