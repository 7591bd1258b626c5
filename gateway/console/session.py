"""Console sessions and the request plumbing every page leans on: signed session cookies, CSRF tokens,
the signed-in and role dependencies, and form parsing.

A session is a cookie holding `key_id.expiry.signature` (HMAC-SHA256 under the server's console
secret); the key itself never leaves the sign-in form. Every request re-reads the key by id, so
revoking it ends its sessions at once. Every form posts a CSRF token, an HMAC of the session token
(of a random sign-in cookie for the sign-in form), on top of the cookie's SameSite=Strict.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Annotated
from urllib.parse import parse_qsl

import anyio
from fastapi import Depends, Request, Response
from sqlalchemy import select

from core.db.database import Database
from core.db.models import ApiKey, Tenant
from gateway.accounting.tenants import Principal
from gateway.api.deps import DatabaseDep, app_config
from gateway.http.errors import APIError

SESSION_COOKIE = "sb_console"
LOGIN_COOKIE = "sb_console_login"  # a random nonce that the sign-in form's CSRF token is bound to
SESSION_SECONDS = 8 * 3600
CONSOLE_ROLES = ("admin", "finance")


class SignIn(Exception):
    """No valid session: send the browser to the sign-in page."""


def console_secret(request: Request) -> bytes:
    """The app's console secret, which signs sessions and CSRF tokens."""
    return app_config(request.app).console_secret.encode()


def _sign(secret: bytes, purpose: str, message: str) -> str:
    # The purpose keeps a signature made for one use (a session) from passing as another (a CSRF token).
    return hmac.new(secret, f"{purpose}:{message}".encode(), hashlib.sha256).hexdigest()


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def small_int(value: str | None) -> int | None:
    """A small non-negative integer, or None: str.isdigit alone lets "²" and 5,000-digit strings through."""
    return int(value) if value and len(value) <= 18 and value.isascii() and value.isdigit() else None


def session_token(secret: bytes, key_id: int, now: float | None = None) -> str:
    body = f"{key_id}.{int((now or time.time()) + SESSION_SECONDS)}"
    return f"{body}.{_sign(secret, 'session', body)}"


def session_key_id(secret: bytes, token: str, now: float | None = None) -> int | None:
    """The key id a well-signed, unexpired token names; None for anything else."""
    key_id, _, rest = token.partition(".")
    expiry, _, signature = rest.partition(".")
    if small_int(key_id) is None or small_int(expiry) is None:
        return None
    if not same(signature, _sign(secret, "session", f"{key_id}.{expiry}")):
        return None
    return int(key_id) if int(expiry) > (now or time.time()) else None


def csrf_token(secret: bytes, session: str) -> str:
    return _sign(secret, "csrf", session)


def login_csrf_token(secret: bytes, nonce: str) -> str:
    """The sign-in form's CSRF token: there is no session yet, so it is bound to the LOGIN_COOKIE nonce."""
    return _sign(secret, "login", nonce)


def principal_by_key_id(db: Database, key_id: int) -> Principal | None:
    """The principal of a live (not revoked) admin or finance key, by id."""
    with db.session() as s:
        row = s.execute(
            select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.id == key_id)
        ).first()
    if row is None:
        return None
    key, tenant = row
    if key.revoked_at is not None or key.role not in CONSOLE_ROLES:
        return None
    return Principal(tenant.id, tenant.name, key.id, key.prefix, key.role, tenant.is_operator)


def set_cookie(request: Request, response: Response, name: str, value: str, max_age: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


async def _signed_in(request: Request, db: DatabaseDep) -> Principal:
    token = request.cookies.get(SESSION_COOKIE, "")
    key_id = session_key_id(console_secret(request), token) if token else None
    principal = None
    if key_id is not None:
        principal = await anyio.to_thread.run_sync(principal_by_key_id, db, key_id)
    if principal is None:
        raise SignIn
    request.state.principal = principal
    request.state.csrf = csrf_token(console_secret(request), token)
    return principal


SignedIn = Annotated[Principal, Depends(_signed_in)]


def signed_in(request: Request) -> Principal | None:
    """Who signed in, once `SignedIn` ran for this request; None before (or on the sign-in page)."""
    principal: Principal | None = getattr(request.state, "principal", None)
    return principal


def page_csrf(request: Request) -> str:
    """The CSRF token this request's forms carry, once `SignedIn` ran; "" before."""
    csrf: str = getattr(request.state, "csrf", "")
    return csrf


def _role(role: str) -> Callable[[Principal], Awaitable[Principal]]:
    async def check(principal: SignedIn) -> Principal:
        if principal.role != role:
            raise APIError(
                403, f"This page needs a key with the {role} role; you signed in with a {principal.role} key."
            )
        return principal

    return check


AdminUser = Annotated[Principal, Depends(_role("admin"))]
FinanceUser = Annotated[Principal, Depends(_role("finance"))]


async def read_form(request: Request) -> dict[str, str]:
    """A urlencoded form body (what a browser's form posts; no multipart library needed)."""
    body = (await request.body()).decode("utf-8", "replace")
    return dict(parse_qsl(body, keep_blank_values=True))


async def _posted(request: Request, _: SignedIn) -> dict[str, str]:
    form = await read_form(request)
    if not same(form.get("csrf", ""), request.state.csrf):  # set by SignedIn
        raise APIError(403, "The form's security token is missing or stale; reload the page and try again.")
    return form


Posted = Annotated[dict[str, str], Depends(_posted)]
