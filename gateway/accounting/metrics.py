"""Prometheus counters and histograms (`GET /metrics` serves them: `gateway.api.metrics`).

Recorded where a request is priced (`gateway.pipeline.metering.Meter.bill`), where a routing decision is
timed and where a 429 leaves (`gateway.http.errors`); the gauges read at scrape time (engines, caches,
single flight, the router's drift) are `gateway.api.metrics`'. Each app has its own registry
(`AppConfig.metrics`): several apps in one process, as in the tests, never share or collide.

Labels carry tiers, endpoints and statuses only, never tenants or prompt text: the label sets stay
small and a scrape reveals no tenant's data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram

if TYPE_CHECKING:
    from gateway.accounting.record import UsageRecord

__all__ = ["FLIGHT_KINDS", "GAUGES", "THROTTLE_CODES", "Metrics"]

# Seconds; CPU engines' first tokens range from tens of milliseconds to tens of seconds under load.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ROUTE_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)  # a routing decision: MiniLM on a CPU

# A single-flight follower's cache status → the `kind` label
FLIGHT_KINDS = {"flight-hit": "exact", "flight-sem-hit": "semantic"}

# 429 codes, as gateway.http.errors sees them → the `reason` label
THROTTLE_CODES = {"insufficient_quota": "budget", "rate_limit_exceeded": "rate_limit"}


# EngineStats.as_dict() key → (metric name after `switchboard_`, help); spec_* only on speculative tiers
GAUGES = {
    "waiting": ("engine_waiting", "Sequences queued"),
    "running": ("engine_running", "Sequences running"),
    "kv_utilization": ("kv_utilization", "KV-cache blocks in use / total (0-1)"),
    "kv_blocks_used": ("kv_blocks_used", "KV-cache blocks in use"),
    "kv_blocks_total": ("kv_blocks_capacity", "KV-cache blocks in all"),
    "spec_acceptance_rate": ("spec_acceptance_rate", "Drafted tokens accepted / proposed (speculative tiers)"),
    "breaker_open": ("breaker_open", "1 while a remote tier's circuit breaker is open (remote tiers)"),
}


class Metrics:
    """The app's metrics and their registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "switchboard_requests", "Requests that ran or were answered from the cache",
            ["tier", "endpoint", "status", "cache"], registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "switchboard_tokens",
            "Tokens by kind: prompt, cached_prompt, completion, draft_proposed, draft_accepted",
            ["tier", "kind"],
            registry=r,
        )
        self.cost = Counter("switchboard_cost_usd", "What tenants were billed, USD", ["tier"], registry=r)
        self.counterfactual = Counter(
            "switchboard_counterfactual_cost_usd", "What the requests would cost with no lever pulled, USD", ["tier"],
            registry=r,
        )  # fmt: skip
        self.routes = Counter(
            "switchboard_routed_requests", "Requests by the tier that served them and how it was chosen",
            ["tier", "route"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "switchboard_ttft_seconds", "Time to the first generated text (engine-run requests)", ["tier"],
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "switchboard_time_per_output_token_seconds", "Time per generated token after the first", ["tier"],
            buckets=TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.route_seconds = Histogram(
            "switchboard_route_seconds", "Time of a routing decision (`auto`), waiting for the router thread included",
            buckets=ROUTE_BUCKETS, registry=r,
        )  # fmt: skip
        self.throttled = Counter(
            "switchboard_throttled_requests", "429s: reason budget (insufficient_quota) or rate_limit", ["reason"],
            registry=r,
        )  # fmt: skip
        self.single_flight = Counter(
            "switchboard_single_flight_hits",
            "Requests served the answer an identical request in the air was generating (kind: exact or semantic)",
            ["tier", "kind"], registry=r,
        )  # fmt: skip

    def record_request(self, rec: UsageRecord, ttft: float | None, seconds: float) -> None:
        """One priced request: its ledger row, its time to first text (None: none was generated) and duration."""
        tier = rec.tier
        self.requests.labels(tier, rec.endpoint, rec.status, rec.cache_status).inc()
        self.routes.labels(tier, rec.route).inc()
        if rec.cache_status in FLIGHT_KINDS:
            self.single_flight.labels(tier, FLIGHT_KINDS[rec.cache_status]).inc()
        kinds = {
            "prompt": rec.prompt_tokens,
            "cached_prompt": rec.cached_prompt_tokens,
            "completion": rec.completion_tokens,
            "draft_proposed": rec.draft_proposed,
            "draft_accepted": rec.draft_accepted,
        }
        for kind, n in kinds.items():
            self.tokens.labels(tier, kind).inc(n)
        self.cost.labels(tier).inc(float(rec.cost))
        self.counterfactual.labels(tier).inc(float(rec.counterfactual_cost))
        if ttft is not None:
            self.ttft.labels(tier).observe(ttft)
            self.tpot.labels(tier).observe(max(0.0, seconds - ttft) / max(1, rec.completion_tokens - 1))

    def record_route(self, seconds: float) -> None:
        self.route_seconds.observe(seconds)

    def record_error(self, status: int, code: str | None) -> None:
        if status == 429:
            self.throttled.labels(THROTTLE_CODES.get(code or "", "other")).inc()
