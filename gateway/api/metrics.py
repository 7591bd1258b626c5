"""`GET /metrics`: the app's Prometheus registry in the text exposition format, and the gauges read at scrape
time from the engines (queue depth, KV use, speculative acceptance, alive), the caches (Redis failures they
absorbed), single flight (leaders, released followers) and the router (its large-tier share against what
was calibrated), so nothing runs in the background. Public unless `metrics_public` is off.

Labels carry tiers, endpoints and statuses only, never tenants or prompt text (`gateway.accounting.metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.accounting.metrics import GAUGES, Metrics
from gateway.api.auth import require_principal, require_role
from gateway.api.deps import app_config, app_services
from gateway.pipeline import Pipeline

__all__ = ["router", "watch"]


def watch(metrics: Metrics, pipeline: Callable[[], Pipeline | None]) -> None:
    """Read engine and cache gauges at scrape time from `pipeline()` (the app's, once it started)."""
    metrics.registry.register(_PipelineCollector(pipeline))


class _PipelineCollector(Collector):
    def __init__(self, pipeline: Callable[[], Pipeline | None]) -> None:
        self.pipeline = pipeline

    def describe(self) -> list[Metric]:
        return []  # names are only known once engines run; an empty describe keeps registration lazy

    def collect(self) -> Iterator[Metric]:
        pipeline = self.pipeline()
        if pipeline is None:  # before startup
            return
        gauges = {
            key: GaugeMetricFamily(f"switchboard_{name}", doc, labels=["tier"]) for key, (name, doc) in GAUGES.items()
        }
        alive = GaugeMetricFamily("switchboard_engine_alive", "1 while the tier's engine thread runs", labels=["tier"])
        for tier, engine in pipeline.engines.items():
            stats = engine.stats().as_dict()
            alive.add_metric([tier], 1.0 if engine.alive else 0.0)
            for key, family in gauges.items():
                if key in stats:
                    family.add_metric([tier], float(stats[key]))
        yield alive
        yield from gauges.values()
        yield from _router_gauges(pipeline)
        errors = CounterMetricFamily(
            "switchboard_cache_errors", "Redis failures the caches absorbed (served as misses)", labels=["cache"]
        )
        cache = pipeline.cache
        if cache is not None:
            errors.add_metric(["response"], float(cache.exact.errors))
            if cache.semantic is not None:
                errors.add_metric(["semantic"], float(cache.semantic.errors))
        yield errors
        yield from _flight_metrics(pipeline)


def _flight_metrics(pipeline: Pipeline) -> Iterator[Metric]:
    """Single flight (`gateway.pipeline.single_flight`): leaders in the air, and followers their leader released."""
    leaders = GaugeMetricFamily(
        "switchboard_single_flight_leaders", "Requests generating an answer others may wait for"
    )
    leaders.add_metric([], float(len(pipeline.flights)))
    released = CounterMetricFamily(
        "switchboard_single_flight_released",
        "Followers whose leader stored no answer (refused, failed, left), so that they ran on their own",
    )
    released.add_metric([], float(pipeline.flights.released))
    yield leaders
    yield released


def _router_gauges(pipeline: Pipeline) -> Iterator[Metric]:
    """Drift of the learned router: its large-tier share over the last decisions, and what was calibrated."""
    shares = pipeline.routing.shares()
    values = {
        "switchboard_router_large_share": (shares.large_share, "Share of the last routing decisions sent large"),
        "switchboard_router_calibrated_large_share": (
            shares.calibrated_large_share,
            "Share of large calls the deciding thresholds were calibrated to send (mean over the same decisions)",
        ),
    }
    for name, (value, doc) in values.items():
        if value is not None:  # no decision yet: no sample rather than a made-up 0
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], value)
            yield gauge


router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text format. Public unless `metrics_public` is off: then an admin key is needed."""
    config = app_config(request.app)
    if not config.settings.metrics_public:
        principal = await require_principal(app_services(request.app).db, request.headers.get("authorization"))
        await require_role("admin")(principal)
    registry: CollectorRegistry = config.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
