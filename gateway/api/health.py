"""Liveness and readiness: `GET /healthz` (no key needed; reveals no tenant data)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(request: Request) -> JSONResponse:
    state = request.app.state
    try:
        await anyio.to_thread.run_sync(state.db.ping)
        database = "ok"
    except Exception as exc:  # report, don't raise: this endpoint exists to say what is wrong
        database = f"unreachable: {type(exc).__name__}"
    engines = {name: {"running": e.engine.num_running, "alive": e.alive} for name, e in state.pipeline.engines.items()}
    healthy = database == "ok" and all(e["alive"] for e in engines.values())
    body = {"status": "ok" if healthy else "degraded", "database": database, "engines": engines}
    return JSONResponse(body, status_code=200 if healthy else 503)
