"""The console's audit log (admin keys): who changed what, with each change as a diff."""

from __future__ import annotations

import anyio
from fastapi import Request, Response

from core import audit
from gateway.accounting.tenants import list_tenants
from gateway.api.deps import DatabaseDep
from gateway.console.render import changes, page, router, visible
from gateway.console.session import AdminUser

AUDIT_LIMIT = 200


@router.get("/audit")
async def audit_log(request: Request, db: DatabaseDep, principal: AdminUser, tenant: str | None = None) -> Response:
    if tenant:
        tenant_id: int | None = (await visible(db, principal, tenant)).id
    else:
        tenant_id = principal.scope
    rows = await anyio.to_thread.run_sync(audit.entries, db, tenant_id, AUDIT_LIMIT)
    visible_tenants = await anyio.to_thread.run_sync(list_tenants, db, principal.scope)
    names = {t.id: t.name for t in visible_tenants}
    entries = [(e, names.get(e.tenant_id, ""), changes(e.before, e.after)) for e in rows]
    return page(
        request, "audit.html", entries=entries, tenants=visible_tenants, selected=tenant or "", limit=AUDIT_LIMIT
    )
