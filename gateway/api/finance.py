"""Finance endpoints (keys with the `finance` role) and a tenant's own usage (any key).

The operator's finance keys see every tenant; another tenant's finance keys see their own. All
answers come from the daily rollup; money is a decimal string, never a float.
"""

from __future__ import annotations

from datetime import date
from typing import Any

import anyio
from fastapi import APIRouter, Query, Response

from core.db.database import Database
from gateway.accounting import reports
from gateway.accounting.tenants import Principal
from gateway.api.auth import CurrentPrincipal, FinancePrincipal, visible_tenant
from gateway.api.deps import DatabaseDep
from gateway.api.params import IsoDate, TenantFilter
from gateway.http.errors import APIError, documented

router = APIRouter(prefix="/v1", tags=["finance"], responses=documented(400, 401, 413, 422, 503))

GROUPS = ("day", "tier", "model")


async def _scope(db: Database, principal: Principal, tenant: str | None) -> list[int] | None:
    if tenant is not None:
        return [(await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)).id]
    return None if principal.scope is None else [principal.scope]


def _groups(group_by: str) -> tuple[Any, ...]:
    parts = tuple(p.strip() for p in group_by.split(",") if p.strip())
    if not parts or any(p not in GROUPS for p in parts):
        raise APIError(422, f"group_by takes a comma-separated subset of {', '.join(GROUPS)}", param="group_by")
    return parts


def _range(start: date | None, end: date | None) -> None:
    if start and end and start > end:
        raise APIError(422, "start must not be after end", param="start")


def _json(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: (str(v) if not isinstance(v, int | float | str) else v) for k, v in r.items()} for r in rows]


@router.get("/finance/costs", responses=documented(403, 404))
async def costs(
    db: DatabaseDep,
    principal: FinancePrincipal,
    tenant: TenantFilter = None,
    start: IsoDate | None = None,
    end: IsoDate | None = None,
    group_by: str = Query("day", description="comma-separated: day, tier, model"),
) -> dict[str, Any]:
    """Cost by tenant and day / tier / model, with tokens by kind and the always-large counterfactual."""
    _range(start, end)
    ids, groups = await _scope(db, principal, tenant), _groups(group_by)
    rows = await anyio.to_thread.run_sync(reports.costs, db, ids, start, end, groups)
    return {"object": "list", "data": _json(rows)}


@router.get(
    "/finance/costs.csv",
    response_class=Response,
    responses={200: {"content": {"text/csv": {"schema": {"type": "string"}}}}, **documented(403, 404)},
)
async def costs_csv(
    db: DatabaseDep,
    principal: FinancePrincipal,
    tenant: TenantFilter = None,
    start: IsoDate | None = None,
    end: IsoDate | None = None,
    group_by: str = "day",
) -> Response:
    _range(start, end)
    ids, groups = await _scope(db, principal, tenant), _groups(group_by)
    rows = await anyio.to_thread.run_sync(reports.costs, db, ids, start, end, groups)
    return Response(
        reports.to_csv(rows),
        media_type="text/csv",
        headers={"content-disposition": f'attachment; filename="switchboard-costs-{tenant or "all"}.csv"'},
    )


@router.get("/finance/savings", responses=documented(403, 404))
async def savings(
    db: DatabaseDep,
    principal: FinancePrincipal,
    tenant: TenantFilter = None,
    start: IsoDate | None = None,
    end: IsoDate | None = None,
) -> dict[str, Any]:
    """Per tenant: cost, the always-large counterfactual, and the saving split by lever."""
    _range(start, end)
    ids = await _scope(db, principal, tenant)
    rows = await anyio.to_thread.run_sync(reports.savings, db, ids, start, end)
    return {"object": "list", "data": _json(rows)}


@router.get("/usage")
async def own_usage(
    db: DatabaseDep, principal: CurrentPrincipal, start: IsoDate | None = None, end: IsoDate | None = None
) -> dict[str, Any]:
    """The calling key's tenant's cost and tokens by day and tier; never another tenant's."""
    _range(start, end)
    rows = await anyio.to_thread.run_sync(reports.costs, db, [principal.tenant_id], start, end, ("day", "tier"))
    return {"object": "list", "data": _json(rows)}
