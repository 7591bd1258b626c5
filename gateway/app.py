"""The FastAPI application: settings, database, engines and routers, put together once."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping

import anyio
from fastapi import FastAPI

from core.db.database import Database
from core.settings import Settings
from engines.protocol import TierEngine
from gateway import errors, openapi
from gateway.api import admin, finance, health, openai
from gateway.api import policies as policy_api
from gateway.api import router as router_api
from gateway.api import tuning as tuning_api
from gateway.body_limit import BodySizeLimit
from gateway.cache_stage import CacheStage
from gateway.console import pages as console
from gateway.ledger import Ledger, spool_path
from gateway.logging_setup import RequestIdMiddleware
from gateway.metrics import Metrics
from gateway.metrics import router as metrics_router
from gateway.pipeline import Pipeline
from gateway.response_cache import ResponseCache
from gateway.routing import RoutingStage
from gateway.semantic_cache import SemanticCache
from gateway.tenants import use_key_secret
from gateway.tuning_schedule import TuningSchedule
from policies.budgets import Budgets
from policies.counters import Counters, LocalCounters, RedisCounters
from policies.proposals import ProposalStore
from policies.store import PolicyStore
from verifiers.probe import AnswerProbe

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None,
    *,
    engines: Mapping[str, TierEngine] | None = None,
    database: Database | None = None,
) -> FastAPI:
    """Build the app. Tests pass ready engines and a database; `switchboard serve` passes neither."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = database or Database(settings.database)
        if settings.auto_migrate:
            db.upgrade()
        ledger = Ledger(db, spool_path(settings.home_dir, db.url))
        if replayed := ledger.replay_spool():
            log.warning("wrote %d spooled usage rows to the database", replayed)
        counters: Counters = (
            RedisCounters(settings.redis_url, settings.redis_namespace) if settings.redis_url else LocalCounters()
        )
        policies = PolicyStore(db)
        cache = CacheStage(
            ResponseCache(settings.redis_url, settings.redis_namespace),
            SemanticCache(settings.redis_url, settings.redis_namespace),
        )
        if engines is None:
            from gateway.tiers import load_engines

            running = load_engines(settings)
        else:
            running = dict(engines)
        for engine in set(running.values()):
            engine.start()
        app.state.db = db
        app.state.policies = policies
        app.state.proposals = ProposalStore(db, policies)
        app.state.budgets = Budgets(db, counters, settings.redis_namespace)
        routing = await anyio.to_thread.run_sync(_routing, settings, running, db, ledger, app.state.budgets, app)
        probe = await anyio.to_thread.run_sync(_probe, settings, routing)
        app.state.pipeline = Pipeline(
            running, ledger, settings, policies, app.state.budgets, cache, app.state.metrics, routing, probe
        )
        app.state.started = int(time.time())
        app.state.tuning = TuningSchedule(db, policies, app.state.proposals, running, settings.home_dir)
        schedule = None
        if settings.tuning_check_seconds > 0:
            schedule = asyncio.create_task(app.state.tuning.run_forever(settings.tuning_check_seconds))
        # Everything loaded so far (models, tokenizers, the ORM, jinja) lives as long as the process: keep it
        # out of the collector's scans. A full collection walked all of it, stalling every request in
        # flight for up to ~0.2 s (the p99 of cache hits); requests' own garbage is collected as before.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            if schedule is not None:
                schedule.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await schedule
            await routing.close()  # shadow runs still going finish first: they need the engines and the ledger
            if engines is None:  # engines passed in belong to the caller
                for engine in set(running.values()):
                    engine.shutdown()
            await ledger.aclose()
            await counters.close()
            await cache.close()
            if database is None:
                db.dispose()

    app = FastAPI(
        title="switchboard",
        summary="An OpenAI-compatible gateway over tiered in-process engines.",
        lifespan=lifespan,
        # FastAPI's OpenTelemetry hooks look up the global providers on every request (~5% of a cache
        # hit's CPU); we export Prometheus metrics and JSON logs ourselves.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so every log line of a request has its id
    app.state.settings = settings
    app.state.metrics = Metrics()  # a registry per app: apps sharing a process never collide
    app.state.metrics.watch(lambda: app.state)
    use_key_secret(settings.key_secret.get_secret_value() if settings.key_secret else None, settings.home_dir)
    # A random secret signs out every console session on restart; set `console_secret` to keep them.
    app.state.console_secret = settings.console_secret or secrets.token_urlsafe(32)
    errors.install(app)
    openapi.install(app)
    app.include_router(openai.router)
    app.include_router(admin.router)
    app.include_router(policy_api.router)
    app.include_router(tuning_api.router)
    app.include_router(finance.router)
    app.include_router(health.router)
    app.include_router(metrics_router)
    app.include_router(router_api.router)
    app.include_router(console.router)
    return app


def _probe(settings: Settings, routing: RoutingStage) -> AnswerProbe | None:
    """The trained answer probe, if one is saved; it shares the router's MiniLM where there is a router."""
    from router_model.encoder import RouterEncoder
    from verifiers.probe import load_probe

    encoder = routing.service.router.embedder if routing.service is not None else RouterEncoder()
    return load_probe(settings.probe_path, encoder)


def _routing(
    settings: Settings, engines: Mapping[str, TierEngine], db: Database, ledger: Ledger, budgets: Budgets, app: FastAPI
) -> RoutingStage:
    """The routing stage, with the trained router if one is saved (MiniLM loads here, not on a first request)."""
    from gateway.shadow import Relabeler
    from router_model.routed_prompts import RoutedPromptStore

    relabeler = Relabeler(engines, settings, ledger, budgets, app.state.metrics)
    return RoutingStage.load(settings.router_path, settings.router_threads, engines, RoutedPromptStore(db), relabeler)
