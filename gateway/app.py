"""The FastAPI application: settings, database, engines and routers, put together once."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import anyio
from fastapi import APIRouter, FastAPI

from core.db.database import Database
from core.settings import Settings
from engines.protocol import TierEngine
from gateway.accounting.ledger import Ledger, spool_path
from gateway.accounting.metrics import Metrics
from gateway.accounting.tenants import use_key_secret
from gateway.adapters import AdapterStore
from gateway.adapters.schedule import DistillSchedule
from gateway.api import adapters as adapters_api
from gateway.api import admin, embeddings, finance, health, models
from gateway.api import metrics as metrics_api
from gateway.api import policies as policy_api
from gateway.api import router as router_api
from gateway.api import tuning as tuning_api
from gateway.api.chat import router as chat_api
from gateway.api.completions import router as completions_api
from gateway.api.deps import AppConfig, Services, app_config, running_pipeline, set_config, set_services
from gateway.api.messages import router as messages_api
from gateway.api.messages.serving import anthropic_error
from gateway.api.responses import router as responses_api
from gateway.cache.exact import ResponseCache
from gateway.cache.semantic import SemanticCache
from gateway.cache.stage import CacheStage
from gateway.console import pages as console
from gateway.http import errors, openapi
from gateway.http.body_limit import BodySizeLimit
from gateway.http.logging_setup import RequestIdMiddleware
from gateway.pipeline import Pipeline
from gateway.pipeline.embeddings import Embeddings
from gateway.routing.bootstrap import RouterBootstrap, start_bootstrap
from gateway.routing.stage import RoutingStage
from gateway.runtime.periodic import every
from gateway.runtime.tuning import TuningSchedule
from grading.sandbox import jail_status
from policies.budgets import Budgets
from policies.counters import Counters, LocalCounters, RedisCounters
from policies.proposals import ProposalStore
from policies.store import PolicyStore
from verifiers.probe import AnswerProbe

log = logging.getLogger(__name__)

# In this order: the OpenAI API first; the console's pages last.
ROUTERS: tuple[APIRouter, ...] = (
    chat_api.router,
    completions_api.router,
    responses_api.router,
    messages_api.router,
    models.router,
    embeddings.router,
    admin.router,
    adapters_api.router,
    policy_api.router,
    tuning_api.router,
    finance.router,
    health.router,
    metrics_api.router,
    router_api.router,
    console.router,
)

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_app(
    settings: Settings | None = None,
    *,
    engines: Mapping[str, TierEngine] | None = None,
    database: Database | None = None,
) -> FastAPI:
    """Build the app. Tests pass ready engines and a database; `switchboard serve` passes neither."""
    settings = settings or Settings()
    app = FastAPI(
        title="switchboard",
        summary="An OpenAI-compatible gateway over tiered in-process engines.",
        lifespan=_lifespan(engines, database),
        # FastAPI's OpenTelemetry hooks look up the global providers on every request (~5% of a cache
        # hit's CPU); we export Prometheus metrics and JSON logs ourselves.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    larger = {adapters_api.ADAPTERS_UPLOAD_PATH: settings.max_adapter_bytes}
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes, larger=larger)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so every log line of a request has its id
    # A random secret signs out every console session on restart; set `console_secret` to keep them.
    config = AppConfig(settings, Metrics(), settings.console_secret or secrets.token_urlsafe(32))
    set_config(app, config)
    metrics_api.watch(config.metrics, lambda: running_pipeline(app))
    use_key_secret(settings.key_secret.get_secret_value() if settings.key_secret else None, settings.home_dir)
    errors.install(app, config.metrics.record_error)
    errors.shape_errors(app, messages_api.PREFIX, anthropic_error)  # Anthropic's clients read their own error shape
    openapi.install(app)
    for router in ROUTERS:
        app.include_router(router)
    return app


@dataclass(frozen=True, slots=True)
class _Running:
    """What startup built: the services, and what shutdown closes besides them."""

    services: Services
    engines: Mapping[str, TierEngine]
    ledger: Ledger
    counters: Counters
    cache: CacheStage
    routing: RoutingStage
    bootstrap: RouterBootstrap | None  # training the router after startup, where there was none


def _lifespan(engines: Mapping[str, TierEngine] | None, database: Database | None) -> Lifespan:
    """Startup and shutdown. Engines and a database passed to `create_app` belong to the caller: not closed."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        config = app_config(app)
        running = await _start(config, engines, database)
        set_services(app, running.services)
        schedules = _schedules(config.settings, running.services)
        # Everything loaded so far (models, tokenizers, the ORM, jinja) lives as long as the process: keep it
        # out of the collector's scans. A full collection walked all of it, stalling every request in
        # flight for up to ~0.2 s (the p99 of cache hits); requests' own garbage is collected as before.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await _stop(running, schedules, own_engines=engines is None, own_database=database is None)

    return lifespan


async def _start(config: AppConfig, engines: Mapping[str, TierEngine] | None, database: Database | None) -> _Running:
    """Open the database, ledger, counters and caches, start the engines, and build the pipeline on them."""
    settings = config.settings
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
    await anyio.to_thread.run_sync(_report_jail)
    running = _start_engines(settings, engines)
    proposals = ProposalStore(db, policies)
    budgets = Budgets(db, counters, settings.redis_namespace)
    routing = await anyio.to_thread.run_sync(_routing, settings, running, db, ledger, budgets, config.metrics, policies)
    probe = await anyio.to_thread.run_sync(_probe, settings, routing)
    bootstrap = await start_bootstrap(settings, routing)  # no router: one is trained once the server is up
    adapters = AdapterStore(db, settings.home_dir)
    pipeline = Pipeline(running, ledger, settings, policies, budgets, cache, config.metrics, routing, probe, adapters)
    started = int(time.time())
    tuning = TuningSchedule(db, policies, proposals, running, settings.home_dir)
    embedder = cache.semantic.embedder if cache.semantic is not None else None  # one MiniLM per process
    services = Services(db, policies, proposals, budgets, pipeline, tuning, started, Embeddings(pipeline, embedder))
    return _Running(services, running, ledger, counters, cache, routing, bootstrap)


def _report_jail() -> None:
    """Say at start whether code checks can run here: the jail's protections, or why there is none."""
    status = jail_status()
    layers = "; ".join(f"{name} {what}" for name, what in status.layers.items())
    if status.available:
        log.info("code jail on: %s", layers)
    else:
        log.warning(
            "no jail for code on this machine (%s): code checks answer 'unavailable' and run nothing. %s",
            status.reason,
            layers,
        )


def _start_engines(settings: Settings, engines: Mapping[str, TierEngine] | None) -> dict[str, TierEngine]:
    """The engines passed in, or the configured tiers' loaded; started."""
    if engines is None:
        from gateway.runtime.tiers import load_engines

        running = load_engines(settings)
    else:
        running = dict(engines)
    for engine in set(running.values()):
        engine.start()
    return running


def _schedules(settings: Settings, services: Services) -> list[asyncio.Task[None]]:
    """The policy-tuning and distill schedules' tasks, unless their `*_check_seconds` turn them off."""
    tasks = []
    if settings.tuning_check_seconds > 0:
        checks = every(settings.tuning_check_seconds, services.tuning.run_due, "checking the tuning schedules")
        tasks.append(asyncio.create_task(checks))
    if settings.distill_check_seconds > 0:
        distill = DistillSchedule(settings, services.db, services.policies)
        checks = every(settings.distill_check_seconds, distill.run_due, "checking the distill schedules")
        tasks.append(asyncio.create_task(checks))
    return tasks


async def _stop(
    running: _Running, schedules: list[asyncio.Task[None]], *, own_engines: bool, own_database: bool
) -> None:
    """Shut down in order: the schedules, routing's shadow runs, then engines, ledger, counters, caches, database."""
    for schedule in schedules:
        schedule.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await schedule
    if running.bootstrap is not None:
        running.bootstrap.stop()  # a router it finishes now is saved for the next start, not served
    await running.routing.close()  # shadow runs still going finish first: they need the engines and the ledger
    if own_engines:
        for engine in set(running.engines.values()):
            engine.shutdown()
    await running.ledger.aclose()
    await running.counters.close()
    await running.cache.close()
    if own_database:
        running.services.db.dispose()


def _probe(settings: Settings, routing: RoutingStage) -> AnswerProbe | None:
    """The trained answer probe, if one is saved; it shares the router's MiniLM where there is a router."""
    from router_model.encoder import RouterEncoder
    from verifiers.probe import load_probe

    encoder = routing.service.router.embedder if routing.service is not None else RouterEncoder()
    return load_probe(settings.probe_path, encoder)


def _routing(
    settings: Settings,
    engines: Mapping[str, TierEngine],
    db: Database,
    ledger: Ledger,
    budgets: Budgets,
    metrics: Metrics,
    policies: PolicyStore,
) -> RoutingStage:
    """The routing stage, with the trained router if one is saved (MiniLM loads here, not on a first request)."""
    from gateway.routing.hidden import HiddenStateSource
    from gateway.routing.shadow import Relabeler
    from router_model.label import tier_model
    from router_model.routed_prompts import RoutedPromptStore

    relabeler = Relabeler(engines, settings, ledger, budgets, metrics)
    stage = RoutingStage.load(
        settings.router_path, settings.router_threads, engines, RoutedPromptStore(db), relabeler, policies
    )
    small = settings.tiers.get("small")
    stage.hidden = HiddenStateSource(
        engines.get("small"), tier_model(small) if small else None,
        max_waiting=settings.router_hidden_max_waiting, timeout_s=settings.router_hidden_timeout_s,
    )  # fmt: skip
    return stage
