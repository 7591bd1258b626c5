"""The FastAPI application: settings, database, engines and routers, put together once."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engines.async_engine import AsyncEngine
from gateway import errors
from gateway.api import admin, health, openai
from gateway.body_limit import BodySizeLimit
from gateway.db.database import Database
from gateway.pipeline import Pipeline
from gateway.settings import Settings
from gateway.usage import UsageRecorder

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None,
    *,
    engines: Mapping[str, AsyncEngine] | None = None,
    database: Database | None = None,
) -> FastAPI:
    """Build the app. Tests pass ready engines and a database; `switchboard serve` passes neither."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = database or Database(settings.database)
        if settings.auto_migrate:
            db.upgrade()
        recorder = UsageRecorder(db, settings.home_dir / "usage-spool.jsonl")
        if replayed := recorder.replay_spool():
            log.warning("wrote %d spooled usage rows to the database", replayed)
        if engines is None:
            from gateway.tiers import load_engines

            running = load_engines(settings)
        else:
            running = dict(engines)
        for engine in set(running.values()):
            engine.start()
        app.state.db = db
        app.state.pipeline = Pipeline(running, recorder, settings)
        app.state.started = int(time.time())
        try:
            yield
        finally:
            if engines is None:  # engines passed in belong to the caller
                for engine in set(running.values()):
                    engine.shutdown()
            if database is None:
                db.dispose()

    app = FastAPI(
        title="switchboard",
        summary="An OpenAI-compatible gateway over tiered in-process engines.",
        lifespan=lifespan,
    )
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    app.state.settings = settings
    errors.install(app)
    app.include_router(openai.router)
    app.include_router(admin.router)
    app.include_router(health.router)
    return app
