"""Admin endpoints (keys with the `admin` role): what the engines are doing right now.

`GET /v1/engine/stats` reports, per tier, queue depth, running sequences, KV-cache use, prefix-cache
hit rate and step times. Counts only: no tenant's prompts or usage appear here.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.auth import AdminPrincipal

router = APIRouter(prefix="/v1", tags=["admin"])


@router.get("/engine/stats")
async def engine_stats(request: Request, _: AdminPrincipal) -> dict[str, dict]:
    engines = request.app.state.pipeline.engines
    return {name: {"alive": e.alive, **e.stats().as_dict()} for name, e in engines.items()}
