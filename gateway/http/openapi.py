"""The OpenAPI document, as clients and fuzzers read it: the bearer key is a security scheme.

The auth dependency reads the `Authorization` header itself (so a missing or malformed one is a 401
in OpenAI's shape, not FastAPI's), which FastAPI would document as an optional header parameter of
every route. Here it becomes what it is: HTTP bearer authentication, required by every route that
reads it. Error responses are declared by the routes themselves (`gateway.http.errors.documented`); FastAPI's
own 422 is not one of them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

BEARER = "bearerAuth"


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                description=app.description,
                routes=app.routes,
            )
            app.openapi_schema = _bearer_auth(doc)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _bearer_auth(doc: dict[str, Any]) -> dict[str, Any]:
    secured = False
    for operations in doc.get("paths", {}).values():
        for operation in operations.values():
            _drop_fastapi_422(operation)
            params = operation.get("parameters", [])
            kept = [p for p in params if not (p.get("in") == "header" and p.get("name", "").lower() == "authorization")]
            if len(kept) == len(params):
                continue
            secured = True
            operation["security"] = [{BEARER: []}]
            if kept:
                operation["parameters"] = kept
            else:
                del operation["parameters"]
    if secured:
        schemes = doc.setdefault("components", {}).setdefault("securitySchemes", {})
        schemes[BEARER] = {"type": "http", "scheme": "bearer", "description": "an API key: `sk-sb-…`"}
    return doc


def _drop_fastapi_422(operation: dict[str, Any]) -> None:
    """FastAPI documents a 422 `HTTPValidationError` on every route with a body or parameters; a body that does not
    fit the schema is a 400 in OpenAI's error shape here (`gateway.http.errors`)."""
    responses = operation.get("responses", {})
    if "HTTPValidationError" in str(responses.get("422", {})):
        del responses["422"]
