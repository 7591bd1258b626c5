"""The console's pages: sign in with an admin or finance key, then manage tenants, keys and policies,
read the audit log, and see costs and savings. Sessions, CSRF and roles live in `session`.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlencode

import anyio
from fastapi import APIRouter, Depends, Request, Response
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates
from sqlalchemy.exc import IntegrityError

from core import audit
from core.db.models import Tenant
from gateway import reports
from gateway.api.policies import served_policy
from gateway.auth import visible_tenant
from gateway.console.chart import cost_chart, usd
from gateway.console.session import (
    CONSOLE_ROLES,
    LOGIN_COOKIE,
    SESSION_COOKIE,
    SESSION_SECONDS,
    AdminUser,
    FinanceUser,
    Posted,
    SignedIn,
    SignIn,
    console_secret,
    login_csrf_token,
    read_form,
    same,
    session_token,
    set_cookie,
    small_int,
)
from gateway.errors import APIError
from gateway.tenants import (
    ROLES,
    Principal,
    TenantError,
    authenticate,
    create_key,
    create_tenant,
    list_keys,
    list_tenants,
    revoke_key,
)
from policies.proposals import ProposalError
from policies.store import PolicyError

HERE = Path(__file__).resolve().parent
AUDIT_LIMIT = 200
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

        async def page(request: Request) -> Response:
            try:
                response = await handler(request)
            except SignIn:
                response = RedirectResponse("/console/login", status_code=303)
            except APIError as exc:
                response = _page(request, "error.html", exc.status, message=exc.message)
            except RequestValidationError:
                response = _page(request, "error.html", 422, message="That address has a malformed parameter.")
            for k, v in HEADERS.items():
                response.headers.setdefault(k, v)
            return response

        return page


router = APIRouter(prefix="/console", route_class=_PageRoute, include_in_schema=False)


# --- helpers -------------------------------------------------------------------------------------------


def _page(request: Request, template: str, status: int = 200, /, **context: Any) -> Response:
    base = {
        "me": getattr(request.state, "principal", None),
        "csrf": getattr(request.state, "csrf", ""),
        "status": status,
    }
    return templates.TemplateResponse(request, template, {**base, **context}, status_code=status)


def _redirect(path: str, **query: Any) -> RedirectResponse:
    params = {k: v for k, v in query.items() if v not in (None, "")}
    return RedirectResponse(path + (f"?{urlencode(params)}" if params else ""), status_code=303)


def _tenant_url(name: str, suffix: str = "") -> str:
    return f"/console/tenants/{quote(name, safe='')}{suffix}"


async def _visible(request: Request, principal: Principal, name: str) -> Tenant:
    return await anyio.to_thread.run_sync(visible_tenant, request.app.state.db, principal, name)


async def _admin_tenant(name: str, request: Request, principal: AdminUser) -> Tenant:
    return await _visible(request, principal, name)


# The tenant a `/tenants/{name}` page is about. Declare it after `Posted`: dependencies resolve in order,
# so a stale form still fails its CSRF check before anyone learns whether the tenant exists.
AdminTenant = Annotated[Tenant, Depends(_admin_tenant)]


# --- sign in and out -----------------------------------------------------------------------------------


@router.get("/static/console.css")
async def stylesheet() -> FileResponse:
    return FileResponse(
        HERE / "static" / "console.css", media_type="text/css", headers={"cache-control": "max-age=3600"}
    )


def _login_page(request: Request, error: str | None = None, status: int = 200) -> Response:
    nonce = secrets.token_urlsafe(16)
    csrf = login_csrf_token(console_secret(request), nonce)
    response = _page(request, "login.html", status, error=error, csrf=csrf, me=None)
    set_cookie(request, response, LOGIN_COOKIE, nonce, 3600)
    return response


@router.get("/login")
async def login_form(request: Request) -> Response:
    return _login_page(request)


@router.post("/login")
async def login(request: Request) -> Response:
    form, secret = await read_form(request), console_secret(request)
    nonce = request.cookies.get(LOGIN_COOKIE, "")
    if not nonce or not same(form.get("csrf", ""), login_csrf_token(secret, nonce)):
        return _login_page(request, "The sign-in form expired; please try again.", 403)
    principal = await anyio.to_thread.run_sync(authenticate, request.app.state.db, form.get("key", "").strip())
    if principal is None:
        return _login_page(request, "That key is not valid (or was revoked).", 401)
    if principal.role not in CONSOLE_ROLES:
        return _login_page(request, f"Only admin and finance keys can sign in; that is an {principal.role} key.", 403)
    response = RedirectResponse("/console", status_code=303)
    set_cookie(request, response, SESSION_COOKIE, session_token(secret, principal.key_id), SESSION_SECONDS)
    response.delete_cookie(LOGIN_COOKIE, path="/console")
    return response


@router.post("/logout")
async def logout(_: Posted) -> Response:
    response = RedirectResponse("/console/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/console", httponly=True, samesite="strict")
    return response


@router.get("")
async def home(request: Request, _: SignedIn) -> Response:
    return _page(request, "home.html")


# --- admin: tenants and keys ---------------------------------------------------------------------------


async def _tenants_page(request: Request, principal: Principal, status: int = 200, **context: Any) -> Response:
    only = None if principal.operator else principal.tenant_id
    rows = await anyio.to_thread.run_sync(list_tenants, request.app.state.db, only)
    return _page(request, "tenants.html", status, tenants=rows, **context)


@router.get("/tenants")
async def tenants(request: Request, principal: AdminUser) -> Response:
    return await _tenants_page(request, principal)


@router.post("/tenants")
async def new_tenant(request: Request, principal: AdminUser, form: Posted) -> Response:
    if not principal.operator:
        raise APIError(403, "Only the operator's admin keys create tenants.")
    name, operator = form.get("name", "").strip(), form.get("operator") == "on"
    try:
        issued = await anyio.to_thread.run_sync(
            lambda: create_tenant(request.app.state.db, name, operator=operator, actor=principal.actor)
        )
    except TenantError as exc:
        return await _tenants_page(request, principal, 422, error=str(exc), name=name)
    # Rendered, not redirected: the new key is shown this once and must not end up in a URL.
    return await _tenants_page(request, principal, 201, issued=issued)


async def _tenant_page(request: Request, tenant: Tenant, status: int = 200, **context: Any) -> Response:
    keys = await anyio.to_thread.run_sync(list_keys, request.app.state.db, tenant.id)
    revoked = request.query_params.get("revoked")
    if not any(k.prefix == revoked and k.revoked_at is not None for k in keys):
        revoked = None  # only ever echo a prefix that names a key this page lists
    return _page(request, "tenant.html", status, tenant=tenant, keys=keys, roles=ROLES, revoked=revoked, **context)


@router.get("/tenants/{name}")
async def tenant(request: Request, t: AdminTenant) -> Response:
    return await _tenant_page(request, t)


@router.post("/tenants/{name}/keys")
async def new_key(request: Request, principal: AdminUser, form: Posted, t: AdminTenant) -> Response:
    role = form.get("role", "")
    if role not in ROLES:
        return await _tenant_page(request, t, 422, error=f"role must be one of {', '.join(ROLES)}")
    issued = await anyio.to_thread.run_sync(
        lambda: create_key(request.app.state.db, t.name, role, actor=principal.actor)
    )
    return await _tenant_page(request, t, 201, issued=issued)


@router.post("/tenants/{name}/keys/revoke")
async def revoke(request: Request, principal: AdminUser, form: Posted, t: AdminTenant) -> Response:
    prefix = form.get("prefix", "")
    try:
        await anyio.to_thread.run_sync(
            lambda: revoke_key(request.app.state.db, prefix, actor=principal.actor, tenant_id=t.id)
        )
    except TenantError as exc:
        raise APIError(404, str(exc)) from None
    return _redirect(_tenant_url(t.name), revoked=prefix)


# --- admin: policies -----------------------------------------------------------------------------------


async def _policy_page(
    request: Request, tenant: Tenant, text: str | None = None, status: int = 200, **context: Any
) -> Response:
    store = request.app.state.policies
    current = await anyio.to_thread.run_sync(store.current, tenant.id)
    history = await anyio.to_thread.run_sync(store.history, tenant.id)
    if text is None:
        text = json.dumps(current.policy.model_dump(mode="json"), indent=2)
    return _page(
        request,
        "policy.html",
        status,
        tenant=tenant,
        current=current,
        history=history,
        text=text,
        served=list(request.app.state.pipeline.engines),
        saved=small_int(request.query_params.get("saved")),
        **context,
    )


@router.get("/tenants/{name}/policy")
async def policy(request: Request, t: AdminTenant) -> Response:
    return await _policy_page(request, t)


@router.post("/tenants/{name}/policy")
async def save_policy(request: Request, principal: AdminUser, form: Posted, t: AdminTenant) -> Response:
    text, note = form.get("policy", ""), form.get("note", "").strip()[:200]
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        problem = {"param": f"line {exc.lineno}, column {exc.colno}", "message": exc.msg}
        return await _policy_page(request, t, text, 422, errors=[problem], note=note)
    if not isinstance(body, dict):
        return await _policy_page(request, t, text, 422, errors=[{"param": None, "message": "must be a JSON object"}])
    try:
        validated = served_policy(body, request)
    except APIError as exc:
        errors = exc.details or [{"param": exc.param, "message": exc.message}]
        return await _policy_page(request, t, text, exc.status, errors=errors, note=note)
    store = request.app.state.policies
    try:
        version = await anyio.to_thread.run_sync(lambda: store.save(t.id, validated, principal.actor, note))
    except IntegrityError:
        problem = {"param": None, "message": "The policy changed at the same moment; reload it and retry."}
        return await _policy_page(request, t, text, 409, errors=[problem], note=note)
    return _redirect(_tenant_url(t.name, "/policy"), saved=version)


@router.post("/tenants/{name}/policy/rollback")
async def rollback(request: Request, principal: AdminUser, form: Posted, t: AdminTenant) -> Response:
    version = small_int(form.get("version"))
    store = request.app.state.policies
    try:
        if version is None:
            raise PolicyError("no version given")
        saved = await anyio.to_thread.run_sync(store.rollback, t.id, version, principal.actor)
    except (PolicyError, IntegrityError) as exc:
        return await _policy_page(request, t, None, 409, errors=[{"param": "version", "message": str(exc)}])
    return _redirect(_tenant_url(t.name, "/policy"), saved=saved)


# --- admin: tuning proposals ---------------------------------------------------------------------------


ProposalNumber = Annotated[int, PathParam(ge=1, le=2**31 - 1)]  # a 32-bit column: larger is a 422, not SQL's error


@router.get("/tenants/{name}/policy/proposals")
async def proposals(request: Request, t: AdminTenant) -> Response:
    rows = await anyio.to_thread.run_sync(request.app.state.proposals.list, t.id)
    return _page(request, "proposals.html", tenant=t, proposals=rows)


async def _proposal_page(request: Request, t: Tenant, pid: int, status: int = 200, **context: Any) -> Response:
    store = request.app.state.proposals
    try:
        p = await anyio.to_thread.run_sync(store.get, t.id, pid)
    except ProposalError as exc:
        raise APIError(404, str(exc)) from None
    base = await anyio.to_thread.run_sync(request.app.state.policies.version, t.id, p.base_version)
    diff = changes(base.policy.model_dump(mode="json"), p.policy, limit=20)
    return _page(request, "proposal.html", status, tenant=t, p=p, r=p.report, changes=diff, **context)


@router.get("/tenants/{name}/policy/proposals/{pid}")
async def proposal(request: Request, pid: ProposalNumber, t: AdminTenant) -> Response:
    return await _proposal_page(request, t, pid)


@router.get("/tenants/{name}/policy/proposals/{pid}/plot.png")
async def proposal_plot(request: Request, pid: ProposalNumber, t: AdminTenant) -> Response:
    try:
        png = await anyio.to_thread.run_sync(request.app.state.proposals.plot, t.id, pid)
    except ProposalError as exc:
        raise APIError(404, str(exc)) from None
    if png is None:
        raise APIError(404, "This proposal has no plot.")
    return Response(png, media_type="image/png")


@router.post("/tenants/{name}/policy/proposals/{pid}/apply")
async def apply_proposal(
    request: Request, pid: ProposalNumber, principal: AdminUser, form: Posted, t: AdminTenant
) -> Response:
    try:
        version = await anyio.to_thread.run_sync(request.app.state.proposals.apply, t.id, pid, principal.actor)
    except ProposalError as exc:
        if exc.code == "not_found":
            raise APIError(404, str(exc)) from None
        return await _proposal_page(request, t, pid, 409, error=str(exc))
    except IntegrityError:
        return await _proposal_page(request, t, pid, 409, error="The policy changed at the same moment; retry.")
    return _redirect(_tenant_url(t.name, "/policy"), saved=version)


@router.post("/tenants/{name}/policy/proposals/{pid}/reject")
async def reject_proposal(
    request: Request, pid: ProposalNumber, principal: AdminUser, form: Posted, t: AdminTenant
) -> Response:
    reason = form.get("reason", "").strip()[:200]
    try:
        await anyio.to_thread.run_sync(lambda: request.app.state.proposals.reject(t.id, pid, principal.actor, reason))
    except ProposalError as exc:
        if exc.code == "not_found":
            raise APIError(404, str(exc)) from None
        return await _proposal_page(request, t, pid, 409, error=str(exc))
    return _redirect(_tenant_url(t.name, f"/policy/proposals/{pid}"))


# --- admin: audit log ----------------------------------------------------------------------------------


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


@router.get("/audit")
async def audit_log(request: Request, principal: AdminUser, tenant: str | None = None) -> Response:
    db = request.app.state.db
    if tenant:
        tenant_id: int | None = (await _visible(request, principal, tenant)).id
    else:
        tenant_id = None if principal.operator else principal.tenant_id
    rows = await anyio.to_thread.run_sync(audit.entries, db, tenant_id, AUDIT_LIMIT)
    visible = await anyio.to_thread.run_sync(list_tenants, db, None if principal.operator else principal.tenant_id)
    names = {t.id: t.name for t in visible}
    entries = [(e, names.get(e.tenant_id, ""), changes(e.before, e.after)) for e in rows]
    return _page(request, "audit.html", entries=entries, tenants=visible, selected=tenant or "", limit=AUDIT_LIMIT)


# --- finance -------------------------------------------------------------------------------------------


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
    request: Request,
    principal: FinanceUser,
    tenant: str | None = None,
    start: str | None = None,
    end: str | None = None,
) -> _Scope:
    first, last = _date(start, "start"), _date(end, "end")
    if first and last and first > last:
        raise APIError(422, "start must not be after end.")
    if tenant:
        ids = [(await _visible(request, principal, tenant)).id]
    else:
        ids = None if principal.operator else [principal.tenant_id]
    return _Scope(tenant, start, end, ids, first, last)


# The finance pages' query parameters (tenant, start, end), checked; it needs the finance role.
FinanceScope = Annotated[_Scope, Depends(_finance_scope)]


@router.get("/finance")
async def finance(request: Request, principal: FinanceUser, scope: FinanceScope) -> Response:
    db, ids, first, last = request.app.state.db, scope.ids, scope.first, scope.last
    costs = await anyio.to_thread.run_sync(reports.costs, db, ids, first, last, ("day", "tier"))
    savings = await anyio.to_thread.run_sync(reports.savings, db, ids, first, last)
    visible = await anyio.to_thread.run_sync(list_tenants, db, None if principal.operator else principal.tenant_id)
    query = {k: v for k, v in (("tenant", scope.tenant), ("start", scope.start), ("end", scope.end)) if v}
    return _page(
        request,
        "finance.html",
        tenants=visible,
        selected=scope.tenant or "",
        start=scope.start or "",
        end=scope.end or "",
        costs=costs,
        savings=savings,
        levers=reports.LEVERS,
        chart=cost_chart(costs),
        csv_url="/console/finance.csv" + (f"?{urlencode(query)}" if query else ""),
    )


@router.get("/finance.csv")
async def finance_csv(request: Request, scope: FinanceScope) -> Response:
    rows = await anyio.to_thread.run_sync(
        reports.costs, request.app.state.db, scope.ids, scope.first, scope.last, ("day", "tier", "model")
    )
    return Response(
        reports.to_csv(rows),
        media_type="text/csv",
        headers={"content-disposition": f'attachment; filename="switchboard-costs-{scope.tenant or "all"}.csv"'},
    )
