"""Console pages for the session itself: the stylesheet, sign in with an admin or finance key, sign out,
and the home page."""

from __future__ import annotations

import secrets

import anyio
from fastapi import Request, Response
from fastapi.responses import FileResponse, RedirectResponse

from gateway.accounting.tenants import authenticate
from gateway.api.deps import DatabaseDep
from gateway.console.render import HERE, page, router
from gateway.console.session import (
    CONSOLE_ROLES,
    LOGIN_COOKIE,
    SESSION_COOKIE,
    SESSION_SECONDS,
    Posted,
    SignedIn,
    console_secret,
    login_csrf_token,
    read_form,
    same,
    session_token,
    set_cookie,
)


@router.get("/static/console.css")
async def stylesheet() -> FileResponse:
    return FileResponse(
        HERE / "static" / "console.css", media_type="text/css", headers={"cache-control": "max-age=3600"}
    )


def _login_page(request: Request, error: str | None = None, status: int = 200) -> Response:
    nonce = secrets.token_urlsafe(16)
    csrf = login_csrf_token(console_secret(request), nonce)
    response = page(request, "login.html", status, error=error, csrf=csrf, me=None)
    set_cookie(request, response, LOGIN_COOKIE, nonce, 3600)
    return response


@router.get("/login")
async def login_form(request: Request) -> Response:
    return _login_page(request)


@router.post("/login")
async def login(request: Request, db: DatabaseDep) -> Response:
    form, secret = await read_form(request), console_secret(request)
    nonce = request.cookies.get(LOGIN_COOKIE, "")
    if not nonce or not same(form.get("csrf", ""), login_csrf_token(secret, nonce)):
        return _login_page(request, "The sign-in form expired; please try again.", 403)
    principal = await anyio.to_thread.run_sync(authenticate, db, form.get("key", "").strip())
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
    return page(request, "home.html")
