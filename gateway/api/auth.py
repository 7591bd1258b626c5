"""Bearer-key authentication as a FastAPI dependency: every `/v1` route gets a `Principal`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

import anyio
from fastapi import Depends, Header

from core.db.database import Database
from core.db.models import Tenant
from gateway.accounting.tenants import Principal, authenticate, recently_authenticated, tenant_by_name
from gateway.api.deps import DatabaseDep
from gateway.http.errors import APIError


async def require_principal(db: DatabaseDep, authorization: Annotated[str | None, Header()] = None) -> Principal:
    """The caller's principal, from its `Authorization: Bearer` key; 401 without a live key."""
    if not authorization:
        raise APIError(
            401,
            "You didn't provide an API key. Send it in the Authorization header as 'Bearer YOUR_KEY'.",
            code="missing_api_key",
        )
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise APIError(401, "The Authorization header must be 'Bearer YOUR_KEY'.", code="invalid_api_key")
    principal = recently_authenticated(db, key) or await anyio.to_thread.run_sync(authenticate, db, key)
    if principal is None:
        raise APIError(401, f"Incorrect API key provided: {_mask(key)}.", code="invalid_api_key")
    return principal


def _mask(key: str) -> str:
    return key[:6] + "*" * 8 + key[-4:] if len(key) > 12 else "*" * len(key)


CurrentPrincipal = Annotated[Principal, Depends(require_principal)]


async def require_api_key(
    db: DatabaseDep,
    x_api_key: Annotated[str | None, Header()] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> Principal:
    """Anthropic's clients send the key as `x-api-key`; `Authorization: Bearer` works there too."""
    if not x_api_key and not authorization:
        raise APIError(401, "You didn't provide an API key. Send it in the x-api-key header.", code="missing_api_key")
    return await require_principal(db, f"Bearer {x_api_key.strip()}" if x_api_key else authorization)


ApiKeyPrincipal = Annotated[Principal, Depends(require_api_key)]


def require_role(*roles: str) -> Callable[[Principal], Awaitable[Principal]]:
    """A dependency that lets only keys with one of `roles` through (403 otherwise)."""

    async def check(principal: CurrentPrincipal) -> Principal:
        if principal.role not in roles:
            raise APIError(
                403,
                f"This endpoint needs a key with the {' or '.join(roles)} role; this key's role is {principal.role}.",
                code="insufficient_role",
            )
        return principal

    return check


AdminPrincipal = Annotated[Principal, Depends(require_role("admin"))]
FinancePrincipal = Annotated[Principal, Depends(require_role("finance"))]
PolicyReader = Annotated[Principal, Depends(require_role("admin", "finance"))]


def visible_tenant(db: Database, principal: Principal, name: str) -> Tenant:
    """The named tenant if this caller may see it; 404 otherwise (whether or not it exists)."""
    tenant = tenant_by_name(db, name)
    if tenant is None or not principal.may_see(tenant.id):
        raise APIError(404, f"No tenant named {name!r} that this key can see.", code="tenant_not_found", param="tenant")
    return tenant
