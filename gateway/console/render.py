"""What every console page leans on: the one router its pages register on (answering in HTML, with the
security headers), its templates, and small helpers: render a page, redirect, find a visible tenant."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlencode

import anyio
from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates

from core.db.database import Database
from core.db.models import Tenant
from gateway.accounting.tenants import Principal
from gateway.api.auth import visible_tenant
from gateway.api.deps import DatabaseDep
from gateway.console.chart import usd
from gateway.console.session import AdminUser, SignIn, page_csrf, signed_in
from gateway.http.errors import APIError

HERE = Path(__file__).resolve().parent
# No scripts at all, styles only from our own stylesheet; forms post only back to us; never framed.
HEADERS = {
    "content-security-policy": "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}

templates = Jinja2Templates(directory=HERE / "templates")
templates.env.filters["usd"] = usd


class _PageRoute(APIRoute):
    """Console routes answer in HTML: errors become a page (not OpenAI-shaped JSON), a missing
    session becomes a redirect, and every answer carries the security headers."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                response = await handler(request)
            except SignIn:
                response = RedirectResponse("/console/login", status_code=303)
            except APIError as exc:
                response = page(request, "error.html", exc.status, message=exc.message)
            except RequestValidationError:
                response = page(request, "error.html", 422, message="That address has a malformed parameter.")
            for k, v in HEADERS.items():
                response.headers.setdefault(k, v)
            return response

        return answer


# Every console page's route; `gateway.console.pages` imports the modules that add them.
router = APIRouter(prefix="/console", route_class=_PageRoute, include_in_schema=False)


def page(request: Request, template: str, status: int = 200, /, **context: Any) -> Response:
    """`template` rendered with `context`, plus who signed in and the forms' CSRF token."""
    base = {"me": signed_in(request), "csrf": page_csrf(request), "status": status}
    return templates.TemplateResponse(request, template, {**base, **context}, status_code=status)


def redirect(path: str, **query: Any) -> RedirectResponse:
    """A 303 to `path`, with the query parameters that have a value."""
    params = {k: v for k, v in query.items() if v not in (None, "")}
    return RedirectResponse(path + (f"?{urlencode(params)}" if params else ""), status_code=303)


def tenant_url(name: str, suffix: str = "") -> str:
    """The tenant's console page (or one under it)."""
    return f"/console/tenants/{quote(name, safe='')}{suffix}"


async def visible(db: Database, principal: Principal, name: str) -> Tenant:
    """The named tenant if this principal may see it; a 404 otherwise."""
    return await anyio.to_thread.run_sync(visible_tenant, db, principal, name)


async def _admin_tenant(name: str, db: DatabaseDep, principal: AdminUser) -> Tenant:
    return await visible(db, principal, name)


# The tenant a `/tenants/{name}` page is about. Declare it after `Posted`: dependencies resolve in order,
# so a stale form still fails its CSRF check before anyone learns whether the tenant exists.
AdminTenant = Annotated[Tenant, Depends(_admin_tenant)]


def changes(before: dict | None, after: dict | None, limit: int = 8) -> list[tuple[str, str, str]]:
    """(path, before, after) for every changed leaf of nested objects: a policy edit reads as
    `sampling.max_tokens_cap: null → 256`, not as two whole policies."""

    def flat(d: dict | None, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in (d or {}).items():
            if isinstance(v, dict) and v:
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    def show(v: Any) -> str:
        s = "—" if v is _ABSENT else json.dumps(v, separators=(",", ":"), default=str)
        return s if len(s) <= 60 else s[:57] + "…"

    b, a = flat(before), flat(after)
    paths = [p for p in dict.fromkeys([*b, *a]) if b.get(p, _ABSENT) != a.get(p, _ABSENT)]
    out = [(p, show(b.get(p, _ABSENT)), show(a.get(p, _ABSENT))) for p in paths[:limit]]
    if len(paths) > limit:
        out.append((f"… {len(paths) - limit} more", "", ""))
    return out


_ABSENT = object()
