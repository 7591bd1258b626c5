"""The console's finance pages (finance keys): costs and savings by day and tier, and their CSV."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from typing import Annotated
from urllib.parse import urlencode

import anyio
from fastapi import Depends, Request, Response

from gateway.accounting import reports
from gateway.accounting.tenants import list_tenants
from gateway.api.deps import DatabaseDep, PipelineDep
from gateway.console.chart import cost_chart
from gateway.console.render import page, router, visible
from gateway.console.session import FinanceUser
from gateway.http.errors import APIError


def _date(value: str | None, name: str) -> date | None:
    if not value:
        return None
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise APIError(422, f"{name} must be a date like 2025-01-31.") from None


@dataclass(frozen=True)
class _Scope:
    """What a finance page reports on: the query as typed (to echo back) and as resolved."""

    tenant: str | None
    start: str | None
    end: str | None
    ids: list[int] | None  # None: every tenant, for the operator
    first: date | None
    last: date | None


async def _finance_scope(
    db: DatabaseDep,
    principal: FinanceUser,
    tenant: str | None = None,
    start: str | None = None,
    end: str | None = None,
) -> _Scope:
    first, last = _date(start, "start"), _date(end, "end")
    if first and last and first > last:
        raise APIError(422, "start must not be after end.")
    if tenant:
        ids = [(await visible(db, principal, tenant)).id]
    else:
        ids = None if principal.scope is None else [principal.scope]
    return _Scope(tenant, start, end, ids, first, last)


# The finance pages' query parameters (tenant, start, end), checked; it needs the finance role.
FinanceScope = Annotated[_Scope, Depends(_finance_scope)]


@router.get("/finance")
async def finance(
    request: Request, db: DatabaseDep, pipeline: PipelineDep, principal: FinanceUser, scope: FinanceScope
) -> Response:
    ids, first, last = scope.ids, scope.first, scope.last
    costs = await anyio.to_thread.run_sync(reports.costs, db, ids, first, last, ("day", "tier"))
    savings = await anyio.to_thread.run_sync(reports.savings, db, ids, first, last)
    visible_tenants = await anyio.to_thread.run_sync(list_tenants, db, principal.scope)
    query = {k: v for k, v in (("tenant", scope.tenant), ("start", scope.start), ("end", scope.end)) if v}
    return page(
        request,
        "finance.html",
        tenants=visible_tenants,
        selected=scope.tenant or "",
        start=scope.start or "",
        end=scope.end or "",
        costs=costs,
        savings=savings,
        levers=reports.LEVERS,
        quality={r["tenant"]: pipeline.routing.floor.summary(r["tenant"]) for r in savings},
        chart=cost_chart(costs),
        csv_url="/console/finance.csv" + (f"?{urlencode(query)}" if query else ""),
    )


@router.get("/finance.csv")
async def finance_csv(db: DatabaseDep, scope: FinanceScope) -> Response:
    rows = await anyio.to_thread.run_sync(
        reports.costs, db, scope.ids, scope.first, scope.last, ("day", "tier", "model")
    )
    return Response(
        reports.to_csv(rows),
        media_type="text/csv",
        headers={"content-disposition": f'attachment; filename="switchboard-costs-{scope.tenant or "all"}.csv"'},
    )
