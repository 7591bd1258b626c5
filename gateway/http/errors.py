"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure a client can cause ends here as a 4xx; anything else is a 500 `server_error` whose
details stay in our logs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import iter_route_contexts
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from core.db.database import UNREACHABLE
from policies.budgets import BudgetError, CountersUnavailable, RateLimited

log = logging.getLogger(__name__)

RETRY_HEADERS = {"retry-after": "1"}  # on a 503 for a dependency that is down: seconds before trying again

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None
    details: list[dict[str, Any]] | None = None  # every problem, where there are several (policies)


class ErrorResponse(BaseModel):
    """What every 4xx and 5xx answer carries, as the OpenAPI document declares it."""

    error: ErrorDetail


_DESCRIPTIONS = {
    400: "A request we cannot serve as asked (unparseable JSON, a field that does not fit the schema: `param` names"
    " it, context too long, unsupported field)",
    401: "A missing, unknown or revoked API key",
    403: "A key without the endpoint's role, or a tier the tenant's policy does not allow",
    404: "An unknown model, or a tenant or key this key cannot see",
    409: "A conflict with the current state (a name taken, a concurrent change)",
    413: "A body over `max_request_bytes`",
    422: "A policy, or an admin's value, that is well formed but not valid here; `param` names the field",
    429: "An exhausted budget or a rate limit",
    503: "Not reachable right now, retry shortly: the model's engine (`engine_unavailable`), the budget counters"
    " (`budget_unavailable`), the database (`database_unavailable`) or, on a first start, the router `auto` needs"
    " (`router_building`)",
}


def documented(*statuses: int, shape: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for error statuses a route can answer, in OpenAI's error shape (or `shape`,
    where an API has its own: Anthropic's under /v1/messages)."""
    return {status: {"model": shape, "description": _DESCRIPTIONS[status]} for status in statuses}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers
        self.details: list[dict[str, Any]] | None = None  # every problem, where there are several

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.details:
            error["details"] = self.details
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_budget(exc: BudgetError) -> APIError:
    """The OpenAI error a budget refusal becomes: the one place a domain refusal gets its HTTP shape."""
    if isinstance(exc, CountersUnavailable):
        return APIError(503, exc.message, code="budget_unavailable", headers={"retry-after": str(exc.retry_after)})
    if isinstance(exc, RateLimited):
        return APIError(
            429,
            exc.message,
            code="rate_limit_exceeded",
            type="rate_limit_error",
            headers={"retry-after": str(exc.retry_after)},
        )
    return APIError(429, exc.message, code="insufficient_quota", type="insufficient_quota")


Shape = Callable[[APIError], dict[str, Any]]  # an API's own error body (Anthropic's, under /v1/messages)


def shape_errors(app: FastAPI, prefix: str, shape: Shape) -> None:
    """Errors on paths under `prefix` leave in `shape` instead of OpenAI's (same status and headers)."""
    app.state.error_shapes = [*getattr(app.state, "error_shapes", []), (prefix, shape)]


def _render(request: Request, exc: APIError) -> JSONResponse:
    for prefix, shape in getattr(request.app.state, "error_shapes", ()):
        if request.url.path.startswith(prefix):
            return JSONResponse(shape(exc), status_code=exc.status, headers=exc.headers)
    return exc.response()


def install(app: FastAPI, on_refusal: Callable[[int, str | None], None] | None = None) -> None:
    """Answer every error in OpenAI's shape; `on_refusal(status, code)` hears each refusal where it leaves (the
    metrics count the budget and rate-limit 429s)."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return _refusal(request, exc, on_refusal)

    async def budget_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, BudgetError)
        return _refusal(request, from_budget(exc), on_refusal)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(BudgetError, budget_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for unreachable in UNREACHABLE:
        app.add_exception_handler(unreachable, _database_unreachable)
    app.add_exception_handler(Exception, _unexpected)


def _refusal(request: Request, exc: APIError, on_refusal: Callable[[int, str | None], None] | None) -> JSONResponse:
    if on_refusal is not None:
        on_refusal(exc.status, exc.code)
    return _render(request, exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return _render(request, invalid("We could not parse the JSON body of your request. It must be valid JSON."))
    if any(e.get("loc") == ("body",) and isinstance(e.get("input"), bytes) for e in errors):
        # FastAPI hands over the raw bytes when the content type is not JSON: say so rather than "not an object"
        sent = request.headers.get("content-type") or "none"
        message = f"The request body must be JSON sent with Content-Type: application/json (this one's: {sent[:100]})."
        return _render(request, APIError(400, message, code="unsupported_content_type"))
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    param = ".".join(loc) or None
    if not loc and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        message = "The request body must be a JSON object."
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return _render(request, APIError(400, message, param=param, code="invalid_value"))  # 400, as OpenAI and Anthropic


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_type_tag(part: object) -> bool:
    """Pydantic names the union member in an error's location (`stop.list[str]`); clients want `stop`."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 413:  # a chunked body that outgrew the limit (gateway.http.body_limit)
        return _render(request, APIError(413, "The request body is too large.", code="request_too_large"))
    if exc.status_code == 400 and exc.detail == _UNPARSEABLE:  # bad UTF-8, nesting too deep for the parser
        message = "We could not parse the JSON body of your request. It must be valid JSON in UTF-8."
        return _render(request, invalid(message))
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:
        headers = {"allow": ", ".join(_allowed_methods(request))}
    messages = {404: "Not found.", 405: "Method not allowed."}
    message = exc.detail if isinstance(exc.detail, str) and exc.detail else messages.get(exc.status_code, "Error.")
    return _render(request, APIError(exc.status_code, message, headers=headers))


_UNPARSEABLE = "There was an error parsing the body"  # FastAPI's words when reading the JSON body failed


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path: Starlette's 405 names only the first route's."""
    methods: set[str] = set()
    for route in iter_route_contexts(request.app.routes):  # included routers' routes too
        if (route_methods := route.methods) and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route_methods
    return sorted(methods)


async def _database_unreachable(request: Request, exc: Exception) -> JSONResponse:
    # An outage, not a bug: a 503 the client may retry, and one log line rather than a stack per request.
    log.warning("database unreachable (%s) on %s %s", type(exc).__name__, request.method, request.url.path)
    message = "The database is unreachable right now; retry shortly."
    return _render(request, APIError(503, message, code="database_unavailable", headers=RETRY_HEADERS))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Our log formatters write the stack and the exception types, never their messages (logging_setup).
    log.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path, exc_info=exc)
    return _render(request, APIError(500, "The server had an error while processing your request."))
