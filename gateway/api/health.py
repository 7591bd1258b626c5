"""Liveness and readiness: `GET /healthz` (no key needed; reveals no tenant data). It also says whether this
machine can jail code (`sandbox`); without a jail the code checks say `unavailable`, and the gateway is
still healthy: it serves every request, without those checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from core.settings import TierSettings
from engines.protocol import TierEngine
from gateway.api.deps import ServicesDep, SettingsDep
from grading.sandbox import jail_status

router = APIRouter(tags=["health"])


class EngineHealth(BaseModel):
    running: int
    alive: bool
    breaker: Literal["closed", "open", "half_open"] | None = Field(None, description="remote tiers' circuit")


class SandboxHealth(BaseModel):
    jail: Literal["on", "unavailable"] = Field(description="whether code checks can run (docs/verifiers.md#the-jail)")
    reason: str = Field(description="why there is no jail; empty when there is one")
    layers: dict[str, str] = Field(description='each protection: "on: ..." or "off: why"')


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    database: str = Field(description='"ok", or why it is unreachable')
    engines: dict[str, EngineHealth]
    sandbox: SandboxHealth = Field(description="the jail for model- and prompt-written code; never makes it degraded")


@router.get("/healthz", response_model=Health, responses={503: {"model": Health, "description": "Something is down"}})
async def healthz(services: ServicesDep, settings: SettingsDep) -> JSONResponse:
    try:
        await anyio.to_thread.run_sync(services.db.ping)
        database = "ok"
    except Exception as exc:  # report, don't raise: this endpoint exists to say what is wrong
        database = f"unreachable: {type(exc).__name__}"
    running = services.pipeline.engines
    engines = {name: _engine_health(e) for name, e in running.items()}
    # A tier that is down while a live fallback serves its requests does not make the gateway unhealthy.
    healthy = database == "ok" and all(_serves(name, running, settings.tiers) for name in running)
    sandbox = (await anyio.to_thread.run_sync(jail_status)).as_dict()  # probed once, at start
    body = {"status": "ok" if healthy else "degraded", "database": database, "engines": engines, "sandbox": sandbox}
    return JSONResponse(body, status_code=200 if healthy else 503)


def _engine_health(engine: TierEngine) -> dict[str, object]:
    stats = engine.stats().as_dict()
    held = stats.get("waiting", 0) + stats["running"]  # queued or generating, as before remote tiers
    health: dict[str, object] = {"running": held, "alive": engine.alive}
    if "breaker" in stats:
        health["breaker"] = stats["breaker"]
    return health


def _serves(name: str | None, engines: Mapping[str, TierEngine], tiers: Mapping[str, TierSettings]) -> bool:
    """Whether the tier, or a tier down its fallback chain, is alive."""
    seen: set[str] = set()
    while name is not None and name not in seen:
        seen.add(name)
        if (engine := engines.get(name)) is not None and engine.alive:
            return True
        name = tiers[name].fallback if name in tiers else None
    return False
