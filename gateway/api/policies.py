"""Policy endpoints: read (admin or finance), write, history, rollback and dry-run (admin only).

A policy that does not validate is a 422 whose `param` is the first bad field's path; every problem
is listed in `error.details`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Body
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from core.db.models import Usage
from gateway.api.auth import AdminPrincipal, PolicyReader, visible_tenant
from gateway.api.deps import DatabaseDep, PipelineDep, PolicyStoreDep
from gateway.api.params import TenantName
from gateway.http.errors import APIError, documented
from gateway.pipeline.policy_check import invalid_policy
from policies.dry_run import replay
from policies.policy import Policy
from policies.store import PolicyError

router = APIRouter(
    prefix="/v1/admin/tenants/{tenant}/policy",
    tags=["policies"],
    responses=documented(400, 401, 403, 404, 413, 422, 503),
)


class PolicyOut(BaseModel):
    tenant: str
    version: int
    policy: Policy
    note: str = ""
    created_by: str = ""
    created_at: datetime | None = None


# Validated by `Pipeline.served_policy` (`gateway.pipeline.policy_check`), which names every bad field
# (FastAPI's own check would name the first).
PolicyBody = Annotated[
    dict[str, Any], Body(description="the policy (the `Policy` schema), plus an optional `note` for its version")
]


class Rollback(BaseModel):
    model_config = ConfigDict(strict=True)

    version: int = Field(ge=0, le=2**31 - 1)  # a 32-bit column


class DryRunIn(BaseModel):
    model_config = ConfigDict(strict=True)

    policy: dict[str, Any] = Field(description="a proposed policy (the `Policy` schema); invalid ones are a 422")
    limit: int = Field(500, ge=1, le=10_000, description="the most recent requests to replay")


def _note(note: object) -> str:
    """The version's note, up to 200 characters of text that PostgreSQL stores (no NUL) and UTF-8 encodes."""
    if isinstance(note, str) and "\x00" not in note:
        try:
            note.encode()
            return note[:200]
        except UnicodeEncodeError:  # a lone surrogate, escaped in the JSON
            pass
    raise APIError(422, "note: must be text without NUL characters", param="note", code="invalid_value")


@router.get("", response_model=PolicyOut)
async def current(tenant: TenantName, db: DatabaseDep, store: PolicyStoreDep, principal: PolicyReader) -> PolicyOut:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    v = await anyio.to_thread.run_sync(store.current, t.id)
    return PolicyOut(tenant=t.name, **v.__dict__)


@router.put("", response_model=PolicyOut, responses=documented(400, 409))
async def update(
    tenant: TenantName,
    body: PolicyBody,
    db: DatabaseDep,
    store: PolicyStoreDep,
    pipeline: PipelineDep,
    principal: AdminPrincipal,
) -> PolicyOut:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    note = _note(body.pop("note", "")) if isinstance(body, dict) else ""
    policy = pipeline.served_policy(body)
    if problems := await pipeline.adapters.missing(t.id, policy):
        raise invalid_policy(problems)
    try:
        version = await anyio.to_thread.run_sync(lambda: store.save(t.id, policy, principal.actor, note))
    except IntegrityError:
        raise APIError(409, "The policy changed at the same moment; reload it and retry.", code="conflict") from None
    return PolicyOut(tenant=t.name, **(await anyio.to_thread.run_sync(store.version, t.id, version)).__dict__)


@router.get("/versions", response_model=list[PolicyOut])
async def versions(
    tenant: TenantName, db: DatabaseDep, store: PolicyStoreDep, principal: PolicyReader
) -> list[PolicyOut]:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    rows = await anyio.to_thread.run_sync(store.history, t.id)
    return [PolicyOut(tenant=t.name, **v.__dict__) for v in rows]


@router.post("/rollback", response_model=PolicyOut, responses=documented(400))
async def rollback(
    tenant: TenantName, body: Rollback, db: DatabaseDep, store: PolicyStoreDep, principal: AdminPrincipal
) -> PolicyOut:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    try:
        version = await anyio.to_thread.run_sync(store.rollback, t.id, body.version, principal.actor)
    except PolicyError as exc:
        raise APIError(404, str(exc), param="version", code="version_not_found") from None
    return PolicyOut(tenant=t.name, **(await anyio.to_thread.run_sync(store.version, t.id, version)).__dict__)


@router.post("/dry-run", responses=documented(400))
async def dry_run(
    tenant: TenantName, body: DryRunIn, db: DatabaseDep, pipeline: PipelineDep, principal: AdminPrincipal
) -> dict[str, Any]:
    """Replay the tenant's most recent requests under `policy`: what it would refuse, cap and cost."""
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    policy = pipeline.served_policy(body.policy)

    def rows() -> list[Usage]:
        with db.session() as s:
            q = select(Usage).where(Usage.tenant_id == t.id).order_by(Usage.created_at.desc()).limit(body.limit)
            return list(s.scalars(q))

    return {"tenant": t.name, **replay(policy, await anyio.to_thread.run_sync(rows)).as_dict()}
