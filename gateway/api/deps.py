"""The app's services, typed: what `create_app` and its startup keep on `app.state`, and a FastAPI
dependency for each, in the FastAPI template's style (`PipelineDep = Annotated[Pipeline, Depends(...)]`).

`app.state` holds two frozen records: `AppConfig`, made in `create_app` (settings, the metrics registry,
the console's secret), and `Services`, made at startup (the database and everything built on it). This
module is the only place that reads or writes them there; code outside a route (middleware, exception
handlers, the console's sessions) calls `app_config(app)` or `app_services(app)`.

The dependencies take nothing but the request, so they add no parameter to the OpenAPI document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from core.db.database import Database
from core.settings import Settings
from gateway.accounting.metrics import Metrics
from gateway.pipeline import Pipeline
from gateway.pipeline.embeddings import Embeddings
from gateway.runtime.tuning import TuningSchedule
from policies.budgets import Budgets
from policies.proposals import ProposalStore
from policies.store import PolicyStore

__all__ = [
    "AppConfig",
    "BudgetsDep",
    "ConfigDep",
    "DatabaseDep",
    "EmbeddingsDep",
    "MetricsDep",
    "PipelineDep",
    "PolicyStoreDep",
    "ProposalStoreDep",
    "Services",
    "ServicesDep",
    "SettingsDep",
    "StartedDep",
    "TuningDep",
    "app_config",
    "app_services",
    "get_budgets",
    "get_config",
    "get_db",
    "get_metrics",
    "get_pipeline",
    "get_policies",
    "get_proposals",
    "get_services",
    "get_settings",
    "get_started",
    "get_tuning",
    "running_pipeline",
    "set_config",
    "set_services",
]


@dataclass(frozen=True, slots=True)
class AppConfig:
    """What `create_app` decides before startup."""

    settings: Settings
    metrics: Metrics  # a registry per app: apps sharing a process never collide
    console_secret: str  # signs console sessions and CSRF tokens


@dataclass(frozen=True, slots=True)
class Services:
    """What startup builds (`create_app`'s lifespan) for the routes to use."""

    db: Database
    policies: PolicyStore
    proposals: ProposalStore
    budgets: Budgets
    pipeline: Pipeline
    tuning: TuningSchedule
    started: int  # Unix time the services came up: the models' `created`
    embeddings: Embeddings


# --- on app.state: set once each, read through these -------------------------------------------------


def set_config(app: FastAPI, config: AppConfig) -> None:
    """Keep `config` on the app (`create_app` does, once)."""
    app.state.config = config


def set_services(app: FastAPI, services: Services) -> None:
    """Keep `services` on the app (startup does, once per start)."""
    app.state.services = services


def app_config(app: FastAPI) -> AppConfig:
    """The app's config; every app `create_app` made has one."""
    config: AppConfig = app.state.config
    return config


def _started(app: FastAPI) -> Services | None:
    services: Services | None = getattr(app.state, "services", None)
    return services


def app_services(app: FastAPI) -> Services:
    """The app's services; RuntimeError before its first startup."""
    if (services := _started(app)) is None:
        raise RuntimeError("the app has not started: its services are built at startup")
    return services


def running_pipeline(app: FastAPI) -> Pipeline | None:
    """The pipeline once the app started (still there after shutdown), None before."""
    services = _started(app)
    return services.pipeline if services is not None else None


# --- dependencies ---------------------------------------------------------------------------------------


async def get_config(request: Request) -> AppConfig:
    """The app's `AppConfig`."""
    return app_config(request.app)


async def get_settings(request: Request) -> Settings:
    """The app's settings."""
    return app_config(request.app).settings


async def get_metrics(request: Request) -> Metrics:
    """The app's metrics registry."""
    return app_config(request.app).metrics


async def get_services(request: Request) -> Services:
    """Everything startup built."""
    return app_services(request.app)


async def get_db(request: Request) -> Database:
    """The database."""
    return app_services(request.app).db


async def get_policies(request: Request) -> PolicyStore:
    """The tenants' policies."""
    return app_services(request.app).policies


async def get_proposals(request: Request) -> ProposalStore:
    """Policy tuning's proposals."""
    return app_services(request.app).proposals


async def get_budgets(request: Request) -> Budgets:
    """The budget and rate-limit counters."""
    return app_services(request.app).budgets


async def get_embeddings(request: Request) -> Embeddings:
    """`POST /v1/embeddings`' service: the in-process embedder and remote tiers, metered."""
    return app_services(request.app).embeddings


async def get_pipeline(request: Request) -> Pipeline:
    """The request pipeline: engines, routing, caches, verifiers and metering."""
    return app_services(request.app).pipeline


async def get_tuning(request: Request) -> TuningSchedule:
    """The tenants' policy-tuning schedule."""
    return app_services(request.app).tuning


async def get_started(request: Request) -> int:
    """When the services came up (Unix time)."""
    return app_services(request.app).started


ConfigDep = Annotated[AppConfig, Depends(get_config)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
ServicesDep = Annotated[Services, Depends(get_services)]
DatabaseDep = Annotated[Database, Depends(get_db)]
PolicyStoreDep = Annotated[PolicyStore, Depends(get_policies)]
ProposalStoreDep = Annotated[ProposalStore, Depends(get_proposals)]
BudgetsDep = Annotated[Budgets, Depends(get_budgets)]
PipelineDep = Annotated[Pipeline, Depends(get_pipeline)]
EmbeddingsDep = Annotated[Embeddings, Depends(get_embeddings)]
TuningDep = Annotated[TuningSchedule, Depends(get_tuning)]
StartedDep = Annotated[int, Depends(get_started)]
