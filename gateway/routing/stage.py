"""The pipeline's routing stage: which tier serves a request that asks for `model: "auto"` (or any
request of a tenant whose policy says `router.route_all`), and what follows its response.

    decision  P(small is good enough) from the trained router (`router_model.serving`, off the event
              loop); small if it is at least the tenant's threshold, else large; then the policy's
              allowed tiers have the last word
    threshold policy mode "quality_ratio" (the default): the one that keeps the floor (raised by a
              recalibration) on the router's held-out curve; mode "threshold": the policy's own; mode
              "large_share": the tenant's calibration (from `switchboard router calibrate --tenant`, if
              made for this router), else the router's per-tenant one (`--prompts --tenant`), else the
              router's global one
    afterwards (once the response is out, `gateway.pipeline.followups`) the conversation is stored for
              calibration (`store`) and, for a share of tiny- and small-tier answers, re-run on the large tier
              and judged (`gateway.routing.shadow`), as the tenant's policy asks; each verdict feeds the
              tenant's quality estimate and may recalibrate it toward large (`gateway.routing.quality_floor`)

Drift: every decision goes into a sliding window (global and per tenant) of large calls against the
share the deciding threshold was calibrated to send (`router_model.drift`), read by `/metrics` and
`GET /v1/admin/router`. The window records the router's own choice, before the policy's tier
restriction: it is the prompts that drift, not the policy.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from engines.protocol import TierEngine
from gateway.accounting.tenants import Principal
from gateway.http.errors import APIError
from gateway.routing.explore import Explorer
from gateway.routing.hidden import HiddenStateSource
from gateway.routing.learning import TenantLearning
from gateway.routing.quality_floor import QualityFloor
from gateway.routing.tier_lock import TierLocks
from policies.policy import Policy
from policies.store import PolicyStore, Versioned
from router_model.drift import LargeShareWindow, Shares
from router_model.features import Messages
from router_model.kinds import TEXT
from router_model.model import LARGE, SMALL, TINY, Assessment, RouterLoadError, cheapest_tier
from router_model.quality import TenantVerdicts
from router_model.routed_prompts import RoutedPromptStore
from router_model.serving import RouterService
from router_model.tenant_layer import LearningVerdicts, Seen, cell_of, posterior_p_ok

if TYPE_CHECKING:
    from gateway.routing.shadow import Relabeler

log = logging.getLogger(__name__)

AUTO = "auto"

LADDER = (TINY, SMALL, LARGE)  # the tiers `auto` picks among, cheapest first
BUILDING_RETRY_AFTER_S = 5  # the `retry-after` of `auto`'s 503 while a router is built after startup


@dataclass(frozen=True)
class RouteDecision:
    tier: str  # the tier it goes to, after the policy's allowed tiers
    p_small_ok: float
    threshold: float
    threshold_from: str  # policy | tenant | floor | global
    calibrated_large_share: float | None  # what the threshold was calibrated to send large; None: a fixed one
    seconds: float  # the decision's time, queueing for the router thread included
    p_ok: dict[str, float] = field(default_factory=dict)  # P(good enough) per tier (the tenant's posterior if learned)
    # (an unknown prompt shows the router's P, and went large whatever it said)
    features: str = "text"  # "hidden": from the small tier's hidden state; "text": the text router decided
    cell: str | None = None  # where the prompt lies (`router_model.tenant_layer.cell_of`): its verdicts count there
    known: bool = True  # the router's labels cover it; else `why` ("tools", "far") and nothing below large unlearned
    why: str = ""
    learned: bool = False  # decided by the tenant's learned routing (`gateway.routing.learning`)
    kind: str = TEXT
    router: str = ""  # the id of the router that decided (its regions name `cell`)


@dataclass(frozen=True)
class Lock:
    """What a chat request's tier lock reads: its conversation's key and whether it continues a tool loop."""

    key: str
    continuing: bool


class RoutingStage:
    def __init__(
        self,
        service: RouterService | None,
        engines: Mapping[str, TierEngine],
        prompts: RoutedPromptStore | None = None,
        relabeler: Relabeler | None = None,
        unavailable: str = "no router is configured",
        policies: PolicyStore | None = None,
    ) -> None:
        self.service = service
        self.engines = engines
        self.locks = TierLocks()
        self.prompts = prompts
        self.relabeler = relabeler
        self.unavailable = unavailable  # why there is no router, for the 404 and the admin stats
        self.building = False  # a router is being built after startup (`gateway.routing.bootstrap`): 503, not 404
        self.drift = LargeShareWindow()
        self.tenant_drift: dict[str, LargeShareWindow] = {}
        self._stale_warned: set[tuple[str, str]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self.hidden: HiddenStateSource | None = None  # the small tier's prefill, for routers trained on it
        self.floor = QualityFloor(relabeler.verdicts if relabeler is not None else TenantVerdicts(), policies)
        self.explorer: Explorer | None = None
        identities: dict[str, str] = {}
        if relabeler is not None:
            self.explorer = Explorer(relabeler)
            identities = self.explorer.identities
            relabeler.on_verdict = self._after_verdict
        self.learning = TenantLearning(
            relabeler.learning if relabeler is not None else LearningVerdicts(),
            self.floor.verdicts,
            identities,
            policies,
        )

    @classmethod
    def load(
        cls,
        directory: Path,
        threads: int,
        engines: Mapping[str, TierEngine],
        prompts: RoutedPromptStore | None = None,
        relabeler: Relabeler | None = None,
        policies: PolicyStore | None = None,
    ) -> RoutingStage:
        """The stage with the router saved in `directory`; without one (or one this code cannot use) `auto`
        answers 404 saying why, and tenants that route everything are served the tier they name."""
        if not directory.exists():
            return cls(None, engines, prompts, relabeler, f"no router is configured (none at {directory})", policies)
        try:
            service = RouterService.load(directory, threads)
        except RouterLoadError as exc:
            log.warning("model auto is unavailable: %s", exc)
            return cls(None, engines, prompts, relabeler, f"no router is configured ({exc})", policies)
        log.info("router loaded from %s (%s)", directory, service.router.metadata.get("classifier"))
        return cls(service, engines, prompts, relabeler, policies=policies)

    def await_router(self, why: str) -> None:
        """A router is being built after startup: until `use_router`, `auto` is a 503 saying `why`."""
        self.building, self.unavailable = True, why

    def use_router(self, service: RouterService | None, unavailable: str = "") -> None:
        """Take the router built after startup (on the event loop); None: building it failed, `unavailable` says why."""
        self.service, self.building = service, False
        self.unavailable = unavailable or self.unavailable

    def wants(self, model: str, policy: Policy) -> bool:
        """Whether this request is routed; `auto` without a router is a 404 naming the reason (503 while one
        is being built)."""
        if model == AUTO and self.service is None and self.building:
            raise APIError(
                503,
                f"The model `auto` is not available yet: {self.unavailable}. Retry in a few seconds, or name a tier.",
                code="router_building",
                param="model",
                headers={"retry-after": str(BUILDING_RETRY_AFTER_S)},
            )
        if model == AUTO and self.service is None:
            raise APIError(
                404,
                f"The model `auto` is not available: {self.unavailable}. Name a tier instead.",
                code="model_not_found",
                param="model",
            )
        return model == AUTO or (policy.router.route_all and self.service is not None)

    def offered(self, policy: Policy) -> bool:
        """Whether `/v1/models` lists `auto` for this policy: a router, and a tier it may route to."""
        return self.service is not None and bool(self._tiers(policy))

    async def route(
        self,
        principal: Principal,
        policy: Policy,
        conversations: Sequence[Messages],
        salt: str = "",
        lock: Lock | None = None,
    ) -> RouteDecision:
        """Decide on the hardest of the request's conversations (a completion may carry several prompts):
        the cheapest allowed tier whose predicted P(good enough) meets the threshold, else the largest.
        `salt`: the request's prefix-cache salt, so the small tier's routing prefill is reused. `lock`: a chat's
        conversation, whose turns inside a tool loop go where it went (`gateway.routing.tier_lock`)."""
        if lock is not None and lock.continuing and policy.router.lock_tool_loops:
            tier = self.locks.get(lock.key)
            if tier is not None and policy.allows(tier):
                return RouteDecision(tier, math.nan, math.nan, "lock", None, 0.0, {}, "lock")
        decision = await self._decide(principal, policy, conversations, salt)
        if lock is not None:
            self.locks.hold(lock.key, decision.tier)
        return decision

    async def _decide(
        self, principal: Principal, policy: Policy, conversations: Sequence[Messages], salt: str
    ) -> RouteDecision:
        assert self.service is not None, "wants() said no router"
        ladder, tiers = self._ladders(policy)
        if not tiers:
            raise APIError(
                403,
                "Your tenant's policy allows none of the tiers `auto` routes between (tiny, small and large).",
                code="model_not_allowed",
                param="model",
            )
        start = time.perf_counter()
        router = self.service.router
        spec = router.hidden_spec
        states: list[np.ndarray | None] = [None] * len(conversations)
        if spec is not None and self.hidden is not None:
            states = list(await asyncio.gather(*(self.hidden.state(spec, list(c), salt) for c in conversations)))
        found = await asyncio.gather(*(self.service.assess(c, s) for c, s in zip(conversations, states, strict=True)))
        place = _hardest(found)  # the hardest conversation decides, and is where its verdicts count
        p_ok = {tier: min(a.p_ok[tier] for a in found) for tier in found[0].p_ok}
        cell = cell_of(place.kind, place.region, place.known)
        learned = self.learning.active(policy, router.id)
        if learned is not None:  # the tenant's own verdicts, over the router's P, at the threshold they support
            used = posterior_p_ok(p_ok, cell, place.known, learned.cells)
            threshold, source, expected = learned.threshold, "learned", learned.large_share
        else:
            threshold, source, expected = self.threshold(policy, principal.tenant_name, place.kind)
            used = p_ok if place.known else dict.fromkeys(p_ok, 0.0)  # unlike the labels: nothing below large yet
        choice = cheapest_tier(used, threshold, ladder)  # the router's own choice, before the policy's tiers
        self.drift.add(choice == LARGE, expected)
        self.tenant_drift.setdefault(principal.tenant_name, LargeShareWindow()).add(choice == LARGE, expected)
        tier = choice if choice in tiers else cheapest_tier(used, threshold, tiers)
        self.floor.add(principal.tenant_name, tier, policy)
        self.learning.add(principal.tenant_name, Seen(cell, place.known, dict(p_ok)), tier == LARGE)
        with_hidden = all(s is not None for s in states) and spec is not None
        shown = used if learned is not None else p_ok  # the header: the router's P, or the tenant's posterior
        return RouteDecision(
            tier, shown[SMALL], threshold, source, expected, time.perf_counter() - start, shown,
            "hidden" if with_hidden else "text", cell, place.known, place.why, learned is not None, place.kind,
            router.id,
        )  # fmt: skip

    async def _after_verdict(self, tenant_id: int, tenant: str) -> None:
        """A shadow or explore verdict came: the floor's check toward large, then the tenant's learning."""
        await self.floor.check(tenant_id, tenant)
        if self.service is not None:
            await self.learning.check(tenant_id, tenant, self.service.router.id, self._tiers)

    def cheaper_tiers(self, policy: Policy) -> list[str]:
        """The tiers below large this tenant's `auto` may pick: what a large-served request is explored on."""
        return [t for t in self._ladders(policy)[1] if t != LARGE]

    def threshold(self, policy: Policy, tenant: str, kind: str | None = None) -> tuple[float, str, float | None]:
        """(threshold, where it came from, the large share it was calibrated to send) for a request of `kind`
        (mode quality_ratio keeps the floor on that kind's own held-out curve)."""
        assert self.service is not None
        router, settings = self.service.router, policy.router
        if settings.mode == "threshold":
            return settings.threshold, "policy", None
        if settings.mode == "quality_ratio":
            # the floor (raised by a recalibration), on a curve that routes to tiny where this tenant may use it
            found = router.threshold_for_floor(settings.floor, tiny=TINY in self._tiers(policy), kind=kind)
            if found is not None:
                return found[0], "floor", found[1]
            return router.threshold, "global", router.large_share_for(None)
        calibration = settings.calibration
        if calibration is not None and calibration.router == router.id:
            return calibration.threshold, "tenant", calibration.large_share
        if calibration is not None and (tenant, router.id) not in self._stale_warned:
            self._stale_warned.add((tenant, router.id))
            log.warning("tenant %s's router calibration is for another router: using the global threshold", tenant)
        if tenant in router.metadata.get("tenant_thresholds", {}):
            return router.threshold_for(tenant), "tenant", router.large_share_for(tenant)
        return router.threshold, "global", router.large_share_for(None)

    def _tiers(self, policy: Policy) -> list[str]:
        """The tiers `auto` may pick for this policy, cheapest first."""
        return [t for t in LADDER if t in self.engines and policy.allows(t)]

    def _ladders(self, policy: Policy) -> tuple[list[str], list[str]]:
        """(the router's ladder, the tiers this policy allows), cheapest first. Mode large_share is calibrated
        on P(small ok) alone, so its ladder is small and large: tiny only where the policy allows nothing else."""
        ladder, tiers = [t for t in LADDER if t in self.engines], self._tiers(policy)
        if policy.router.mode == "large_share":
            return [t for t in ladder if t != TINY], [t for t in tiers if t != TINY] or tiers
        return ladder, tiers

    def store(self, tenant_id: int, request_id: str, conversations: Sequence[Messages], route: RouteDecision) -> None:
        """Keep a routed request's conversations for calibration (`router.store_prompts`), off the response's
        path. Never blocks."""
        store = self.prompts
        if store is None:
            return

        async def stored() -> None:
            for conversation in conversations:
                await anyio.to_thread.run_sync(
                    store.add, tenant_id, request_id, conversation, route.p_small_ok, route.tier
                )

        self._spawn(stored(), f"storing routed prompts of {request_id}")

    def _spawn(self, work: Coroutine[object, object, None], name: str) -> None:
        async def guarded() -> None:
            try:
                await work
            except Exception:  # a lost calibration prompt is not worth a traceback that could quote it
                log.warning("%s failed", name)

        task = asyncio.get_running_loop().create_task(guarded(), name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def shares(self) -> Shares:
        return self.drift.shares()

    def stats(self, tenants: set[str] | None) -> dict[str, object]:
        """What `GET /v1/admin/router` shows; `tenants`: the ones the caller may see (None: all)."""
        out: dict[str, object] = {"loaded": self.service is not None}
        if self.service is None:
            out["reason"], out["building"] = self.unavailable, self.building
        else:
            meta = self.service.router.metadata
            out["router"] = {
                "id": self.service.router.id,
                "classifier": meta.get("classifier"),
                "feature_version": meta.get("feature_version"),
                "created": meta.get("created"),
                "threshold": self.service.router.threshold,
                "threshold_from": meta.get("threshold_from"),
                "large_share": meta.get("large_share"),
                "features": meta.get("features", "text"),
                "hidden": meta.get("hidden"),
                "predicts": [SMALL, *self.service.router.cheaper],
            }
            if self.hidden is not None:  # how often the hidden state was at hand, and why not
                out["hidden_states"] = dict(self.hidden.counts)
        out["drift"] = self.drift.shares().as_dict() if tenants is None else None
        out["tenants"] = {
            name: window.shares().as_dict()
            | {"quality": self.floor.summary(name), "learning": self.learning_summary(name)}
            for name, window in sorted(self.tenant_drift.items())
            if tenants is None or name in tenants
        }
        return out

    def learning_summary(self, tenant: str, policy: Policy | None = None) -> dict[str, Any] | None:
        """The tenant's learning (`TenantLearning.summary`, and the explore share now) under `policy` (default: the
        one its last routed request ran under); None before its first routed request, or without a router."""
        seen = self.floor.policies_seen.get(tenant)
        policy = policy or seen
        if seen is None or policy is None or self.service is None:
            return None
        out = self.learning.summary(tenant, policy, self.service.router.id, self._tiers(policy))
        explorer = self.explorer
        share = explorer.share(Versioned(0, policy), tenant, self.service.router.id) if explorer is not None else 0.0
        out["explore"] = {**out["explore"], "share": share}
        return out

    async def close(self) -> None:
        if self.explorer is not None:
            await self.explorer.close()
        if self.relabeler is not None:
            await self.relabeler.close()
        if self._background:
            await asyncio.wait(list(self._background), timeout=10.0)
        if self.service is not None:
            self.service.close()


def _hardest(found: Sequence[Assessment]) -> Assessment:
    """The assessment that decides a request of several conversations: the lowest P(small ok), unless one is
    unlike the labels (then the first such: it keeps the request off the cheaper tiers until learned)."""
    unknown = [a for a in found if not a.known]
    return unknown[0] if unknown else min(found, key=lambda a: a.p_ok[SMALL])
