"""ASGI middleware: bodies over the configured size get HTTP 413 in OpenAI's error shape.

A declared Content-Length is checked before the app runs. A chunked body is counted as it streams in;
going over raises a 413 `HTTPException`, which FastAPI passes through its body parsing untouched, so
the app's own error handler answers. (FastAPI's built-in `max_body_size` answers a declared oversize
body in plain text, hence this.)
"""

from __future__ import annotations

import re

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.errors import APIError


class BodyTooLarge(HTTPException):
    def __init__(self) -> None:
        super().__init__(413, "The request body is too large.")


class BodySizeLimit:
    """`max_bytes` for every body, except a POST whose path matches one of `larger`'s patterns (an adapter's upload),
    which gets that pattern's limit."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = [(re.compile(pattern), limit) for pattern, limit in (larger or {}).items()]

    def limit(self, scope: Scope) -> int:
        if scope.get("method") == "POST":
            for pattern, limit in self.larger:
                if pattern.fullmatch(scope.get("path", "")):
                    return limit
        return self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.limit(scope)
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > max_bytes:
            error = APIError(413, f"The request body exceeds {max_bytes} bytes.", code="request_too_large")
            await error.response()(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    raise BodyTooLarge
            return message

        await self.app(scope, counting_receive, send)
