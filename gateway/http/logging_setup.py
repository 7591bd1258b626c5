"""Structured logs: one JSON object per line, each carrying the request id of the HTTP request it
belongs to.

    {"ts": "2025-01-01T12:00:00.123Z", "level": "INFO", "logger": "uvicorn.access",
     "message": "127.0.0.1:5000 - \"POST /v1/chat/completions HTTP/1.1\" 200", "request_id": "...",
     "client": "127.0.0.1:5000", "method": "POST", "path": "/v1/chat/completions", "status": 200}

The request id is the client's `x-request-id` header if it sent a sane one, else a new uuid, echoed in
the response's `x-request-id` header. Once a completion request passed its checks, its id takes over
(`chatcmpl-…`): the id in the response body, its `x-request-id` header, its ledger row and the rest
of its log lines, the access line included, then agree. Prompts and completions are
not logged unless the tenant's policy opts in (`logging.log_prompts`, see gateway.pipeline.prompt_log): no
other log call passes message or prompt text, the access log records the path only (bodies and
headers never), and an unhandled error logs its stack and exception types, not their messages.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import traceback
import uuid
from datetime import UTC, datetime
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

# A client-chosen id goes into every log line: keep it short and printable so it cannot forge lines.
_SANE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

# LogRecord's own attributes; anything else on a record came from `extra=` and is logged as a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def exception_stack(exc: BaseException) -> str:
    """The tracebacks of `exc` and the exceptions it chains, oldest first, each named by its type only.

    Exception messages stay out of the logs: one can quote the request (pydantic's quote the input, a
    KeyError its key), and prompts, completions and keys must never reach them. The stack says where.
    """
    chain: list[traceback.TracebackException] = []
    te: traceback.TracebackException | None = traceback.TracebackException.from_exception(exc)
    while te is not None:
        chain.append(te)
        te = te.__cause__ or (None if te.__suppress_context__ else te.__context__)
    parts: list[str] = []
    for te in reversed(chain):
        parts += ["Traceback (most recent call last):\n", *te.stack.format()]
        parts.append(f"{te.exc_type.__module__}.{te.exc_type.__qualname__}\n" if te.exc_type else "?\n")
    return "".join(parts).rstrip("\n")


class _WithoutMessages(logging.Formatter):
    def formatException(self, ei: Any) -> str:
        return exception_stack(ei[1]) if ei and ei[1] is not None else super().formatException(ei)


class JSONFormatter(_WithoutMessages):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        # An id the call names itself beats the ambient one (a line about a request, logged from elsewhere).
        if (rid := getattr(record, "request_id", None) or request_id_var.get()) is not None:
            entry["request_id"] = rid
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, path, _, status = record.args  # uvicorn's access-log arguments
            entry.update(client=client, method=method, path=path, status=status)
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str = "info", fmt: str = "json", handler: logging.Handler | None = None) -> logging.Handler:
    """Point the root logger at one handler (stderr unless given) in `fmt`; uvicorn's loggers propagate to it."""
    handler = handler or logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JSONFormatter())
    else:
        handler.setFormatter(_WithoutMessages("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # no handlers of their own: one format
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    return handler


class RequestIdMiddleware:
    """Sets `request_id_var` for the request's lifetime; returns it as `x-request-id` unless the app set one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers", ())).get(b"x-request-id", b"").decode("latin-1")
        rid = sent if _SANE_ID.fullmatch(sent) else uuid.uuid4().hex
        token = request_id_var.set(rid)

        async def send_with_id(message: Message) -> None:
            headers = message.get("headers", [])
            if message["type"] == "http.response.start" and all(k.lower() != b"x-request-id" for k, _ in headers):
                message["headers"] = [*headers, (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)
