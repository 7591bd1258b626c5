"""Admin endpoints (keys with the `admin` role): tenants, keys, the audit log and engine stats.

An admin key of the operator's tenant manages every tenant; any other tenant's admin key manages its
own tenant only, and other tenants do not exist for it (404).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import anyio
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from core import audit
from gateway.accounting.tenants import (
    OperatorOnly,
    TenantError,
    create_key,
    create_tenant,
    list_keys,
    list_tenants,
    revoke_key,
)
from gateway.api.auth import AdminPrincipal, visible_tenant
from gateway.api.deps import DatabaseDep, PipelineDep
from gateway.api.params import KeyPrefix, TenantFilter, TenantName
from gateway.http.errors import APIError, documented

router = APIRouter(prefix="/v1", tags=["admin"], responses=documented(400, 401, 403, 413, 422, 503))


class TenantOut(BaseModel):
    id: int
    name: str
    operator: bool
    created_at: datetime


class NewTenant(BaseModel):
    model_config = ConfigDict(strict=True)  # `"operator": 0` is a mistake to point out, not a False

    name: str = Field(min_length=1, max_length=100)
    operator: bool = False


class NewKey(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["app", "admin", "finance"] = "app"


class IssuedKeyOut(BaseModel):
    tenant: str
    key: str = Field(description="shown once; only its hash is stored")
    prefix: str
    role: str


class KeyOut(BaseModel):
    prefix: str
    role: str
    created_at: datetime
    revoked_at: datetime | None


class AuditOut(BaseModel):
    id: int
    tenant_id: int | None
    actor: str
    action: str
    target: str
    before: dict | None
    after: dict | None
    created_at: datetime


@router.get("/engine/stats")
async def engine_stats(pipeline: PipelineDep, _: AdminPrincipal) -> dict[str, dict]:
    """Per tier: queue depth, running sequences, KV-cache use, prefix-cache hits, step times. Counts only."""
    engines = pipeline.engines
    return {name: {"alive": e.alive, **e.stats().as_dict()} for name, e in engines.items()}


@router.get("/admin/tenants", response_model=list[TenantOut])
async def tenants(db: DatabaseDep, principal: AdminPrincipal) -> list[TenantOut]:
    only = principal.scope
    rows = await anyio.to_thread.run_sync(list_tenants, db, only)
    return [TenantOut(id=t.id, name=t.name, operator=t.is_operator, created_at=t.created_at) for t in rows]


@router.post("/admin/tenants", response_model=IssuedKeyOut, status_code=201, responses=documented(400, 409))
async def new_tenant(body: NewTenant, db: DatabaseDep, principal: AdminPrincipal) -> IssuedKeyOut:
    try:
        issued = await anyio.to_thread.run_sync(
            lambda: create_tenant(db, body.name, operator=body.operator, actor=principal.actor, by=principal)
        )
    except OperatorOnly as exc:
        raise APIError(403, str(exc), code="insufficient_role") from None
    except TenantError as exc:
        raise APIError(409 if "exists" in str(exc) else 422, str(exc), param="name", code="invalid_tenant") from None
    return IssuedKeyOut(**issued.__dict__)


@router.get("/admin/tenants/{tenant}/keys", response_model=list[KeyOut], responses=documented(404))
async def keys(tenant: TenantName, db: DatabaseDep, principal: AdminPrincipal) -> list[KeyOut]:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    rows = await anyio.to_thread.run_sync(list_keys, db, t.id)
    return [KeyOut(prefix=k.prefix, role=k.role, created_at=k.created_at, revoked_at=k.revoked_at) for k in rows]


@router.post(
    "/admin/tenants/{tenant}/keys", response_model=IssuedKeyOut, status_code=201, responses=documented(400, 404)
)
async def new_key(tenant: TenantName, body: NewKey, db: DatabaseDep, principal: AdminPrincipal) -> IssuedKeyOut:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    issued = await anyio.to_thread.run_sync(lambda: create_key(db, t.name, body.role, actor=principal.actor))
    return IssuedKeyOut(**issued.__dict__)


@router.delete("/admin/keys/{prefix}", status_code=204, responses=documented(404))
async def revoke(prefix: KeyPrefix, db: DatabaseDep, principal: AdminPrincipal) -> None:
    scope = principal.scope
    try:
        await anyio.to_thread.run_sync(lambda: revoke_key(db, prefix, actor=principal.actor, tenant_id=scope))
    except TenantError as exc:
        raise APIError(404, str(exc), param="prefix", code="key_not_found") from None


@router.get("/admin/audit", response_model=list[AuditOut], responses=documented(404))
async def audit_log(
    db: DatabaseDep, principal: AdminPrincipal, tenant: TenantFilter = None, limit: int = 100
) -> list[AuditOut]:
    if tenant is not None:
        tenant_id: int | None = (await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)).id
    else:
        tenant_id = principal.scope
    rows = await anyio.to_thread.run_sync(audit.entries, db, tenant_id, max(1, min(limit, 1000)))
    return [AuditOut.model_validate(r, from_attributes=True) for r in rows]
