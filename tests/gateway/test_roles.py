"""Roles on every route, found by walking the app's router rather than listed by hand: a route added
later without a key check fails here.

Without a key every route answers 401 in OpenAI's shape, except the documented public ones (health,
the OpenAPI document and its viewers, the console's sign-in page and stylesheet); console pages,
which sign in with a session cookie instead, send the browser to the sign-in page. A plain tenant
(`app`) key gets 403 `insufficient_role` on every admin and finance route (and on /metrics once it is
not public), and cannot sign in to the console at all.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from fastapi.routing import iter_route_contexts

import services
from engines.async_engine import AsyncEngine
from gateway.api.deps import app_config
from gateway.console.session import LOGIN_COOKIE, login_csrf_token
from live import LiveServer, serve_gateway

PUBLIC = {"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/console/login"}
PUBLIC |= {"/console/static/console.css"}
ADMIN_OR_FINANCE = re.compile(r"^/v1/(admin|finance|engine)/|^/metrics$")
# A value for each path parameter that passes its pattern, so the key check is what answers.
PATH_VALUES = {
    "tenant": "acme",
    "name": "acme",
    "prefix": "sk-sb-0123456789",
    "model": "small",
    "proposal": "1",
    "pid": "1",
    "response_id": "resp-0",
    "tier": "small",
}


@pytest.fixture(scope="module")
def live(
    small_engine: AsyncEngine, postgres_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    url, drop = services.create_database(postgres_server)
    server, stop = serve_gateway(small_engine, tmp_path_factory.mktemp("home"), url, metrics_public=False)
    yield server
    stop()
    drop()


def every_route(live: LiveServer) -> list[tuple[str, str]]:
    """(method, path template) of every route the app serves, included routers' routes too."""
    routes = [(m, r.path) for r in iter_route_contexts(live.app.routes) for m in sorted(r.methods or ()) if m != "HEAD"]
    assert len(routes) > 30 and ("POST", "/v1/chat/completions") in routes  # the walk found the routers
    return routes


def call(live: LiveServer, method: str, template: str, key: str | None = None) -> httpx.Response:
    path = re.sub(r"\{(\w+)\}", lambda m: PATH_VALUES[m.group(1)], template)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
    return httpx.request(method, f"{live.base_url}{path}", headers=headers, follow_redirects=False, **body)


def test_without_a_key_every_route_but_the_public_ones_is_401(live: LiveServer) -> None:
    checked = 0
    for method, template in every_route(live):
        if template in PUBLIC:
            continue
        r = call(live, method, template)
        if template.startswith("/console"):  # no session: to the sign-in page, never the page itself
            assert r.status_code == 303 and r.headers["location"] == "/console/login", (method, template)
        else:
            assert r.status_code == 401, (method, template, r.status_code)
            if template.startswith("/v1/messages"):  # Anthropic's error shape there
                assert r.json()["error"]["type"] == "authentication_error", (method, template)
            else:
                assert r.json()["error"]["code"] == "missing_api_key", (method, template)
        checked += 1
    assert checked > 25


def test_the_public_routes_need_no_key(live: LiveServer) -> None:
    for method, template in every_route(live):
        if template in PUBLIC and method == "GET":
            assert call(live, method, template).status_code == 200, template


def test_an_app_key_gets_403_on_every_admin_and_finance_route(live: LiveServer) -> None:
    key = live.new_key("acme")  # the tenant the path parameters name: only the role can refuse it
    guarded = [(m, t) for m, t in every_route(live) if ADMIN_OR_FINANCE.search(t)]
    assert len(guarded) >= 15
    for method, template in guarded:
        r = call(live, method, template, key)
        assert r.status_code == 403, (method, template, r.status_code, r.text)
        assert r.json()["error"]["code"] == "insufficient_role" and r.json()["error"]["type"] == "permission_error"
    # Everything else under /v1 is an app key's to use: no 401 or 403 there.
    for method, template in every_route(live):
        if template.startswith("/v1/") and not ADMIN_OR_FINANCE.search(template):
            assert call(live, method, template, key).status_code not in (401, 403), (method, template)


def test_an_app_key_cannot_sign_in_to_the_console(live: LiveServer) -> None:
    key = live.new_key()
    secret = app_config(live.app).console_secret.encode()
    with httpx.Client(base_url=live.base_url, follow_redirects=False) as browser:
        browser.cookies.set(LOGIN_COOKIE, "nonce", path="/console")
        r = browser.post("/console/login", data={"csrf": login_csrf_token(secret, "nonce"), "key": key})
        assert r.status_code == 403 and "sb_console" not in r.cookies
        # A bearer header is not a console session either.
        assert browser.get("/console/tenants", headers={"Authorization": f"Bearer {key}"}).status_code == 303
