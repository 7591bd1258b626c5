"""Each tenant's routing learned from its own verdicts, both ways (`router_model.tenant_layer`), saved as policy
versions.

    window   the tenant's last 1,000 routed prompts as the router placed them (cell, P per cheaper tier, and
             whether they went large): the mix its floor is re-estimated on
    check    after each verdict (shadow or explore) of a tenant in mode `quality_ratio` with `router.learn`, once
             MIN_FRESH verdicts have come since the last learning: the threshold whose routing of the window, by
             the posterior of each prompt's cell, keeps the 95% low end of the estimated quality above the floor
             (`quality_ratio` itself: a recalibration's offset corrects the shipped curve, which this does not read)
             is saved as `router.learned` with the cells' counts (a snapshot: every
             replica routes alike), audited as `policy.recalibrate` by `switchboard`. The first learning is saved
             only where it sends fewer prompts large than the shipped routing did (toward small and tiny); later
             ones move either way, and one that finds no threshold clearing the floor removes the learned
             routing (toward large). The shadow estimate (`gateway.routing.quality_floor`) restarts on fresh
             verdicts after each, and, short, recalibrates toward large as before (removing the learned routing)
    reset    a policy version without the learned routing whose `learn_since` is now: what came before is not
             learned from again (`policy.reset_learning`)

Verdicts count for the tier identity they judged (model, weights, dtype, and the tenant's adapter where its
policy serves the tier under one: `identities_for`): a changed tier, or a tier under a newly deployed adapter, has
none until its own come, and routing learned for another identity (or another router's regions) is not applied.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from gateway.routing.shadow_rows import adapted
from policies.policy import LearnedRouting, Policy
from policies.store import PolicyStore, Versioned
from router_model.model import LARGE
from router_model.quality import TenantVerdicts
from router_model.tenant_layer import MIN_FRESH, LearningVerdicts, Seen, learn_threshold, tenant_curve

__all__ = ["ACTION_RESET", "MIN_SEEN", "WINDOW", "TenantLearning", "identities_for"]

log = logging.getLogger(__name__)

ACTOR = "switchboard"
ACTION = "policy.recalibrate"
ACTION_RESET = "policy.reset_learning"
WINDOW = 1000  # routed prompts a tenant's floor is re-estimated on
MIN_SEEN = 20  # routed prompts before its mix is worth estimating on


def identities_for(identities: Mapping[str, str], policy: Policy) -> dict[str, str]:
    """The tiers' identities for a tenant: each tier its policy serves under an adapter (`Policy.adapters`) with
    that adapter's name, as the verdicts on its answers record it (`gateway.routing.shadow_rows.adapted`)."""
    return {t: adapted(identity, policy.adapters.get(t)) for t, identity in identities.items()}


class TenantLearning:
    def __init__(
        self,
        verdicts: LearningVerdicts,
        shadow: TenantVerdicts,
        identities: Mapping[str, str],
        policies: PolicyStore | None = None,
    ) -> None:
        self.verdicts = verdicts
        self.shadow = shadow  # the shadow verdicts' count restarts the estimate after each learning
        self.identities = dict(identities)  # tier → model@weights/dtype, as the label rows record it
        self.policies = policies
        self._seen: dict[str, deque[Seen]] = {}
        self._large: dict[str, deque[bool]] = {}  # per prompt of the window: whether its routing sent it large
        self._lock = asyncio.Lock()  # one learning at a time

    def of(self, policy: Policy) -> dict[str, str]:
        """The tiers' identities for a tenant under `policy` (`identities_for`)."""
        return identities_for(self.identities, policy)

    def add(self, tenant: str, seen: Seen, large: bool) -> None:
        """A routed prompt of `tenant`, as the router placed it, and whether it went large."""
        self._seen.setdefault(tenant, deque(maxlen=WINDOW)).append(seen)
        self._large.setdefault(tenant, deque(maxlen=WINDOW)).append(large)

    def active(self, policy: Policy, router: str) -> LearnedRouting | None:
        """The tenant's learned routing where it applies: learning on, mode quality_ratio, made for this router
        and for the tiers' identities as they are now."""
        settings = policy.router
        learned = settings.learned
        if learned is None or not settings.learn or settings.mode != "quality_ratio" or learned.router != router:
            return None
        here = self.of(policy)
        if any(here.get(tier) != identity for tier, identity in learned.identities.items()):
            return None
        return learned

    def fresh(self, tenant: str, policy: Policy, router: str) -> int:
        """Verdicts for the current tiers since the tenant's last learning (or reset)."""
        learned = self.active(policy, router)
        total = self.verdicts.count(tenant, self.of(policy), router, since=policy.router.learn_since)
        return total - (learned.verdicts if learned is not None else 0)

    async def check(
        self, tenant_id: int, tenant: str, router: str, tiers: Callable[[Policy], Sequence[str]]
    ) -> Versioned | None:
        """After a verdict: learn the tenant's threshold again where enough fresh verdicts came (see the module's
        docstring); the new policy version, or None. `tiers`: the ladder a policy's `auto` picks from."""
        if self.policies is None:
            return None
        async with self._lock:
            store = self.policies
            current = await anyio.to_thread.run_sync(store.current, tenant_id)
            settings = current.policy.router
            if settings.mode != "quality_ratio" or not settings.learn:
                return None
            if self.fresh(tenant, current.policy, router) < MIN_FRESH or len(self._seen.get(tenant, ())) < MIN_SEEN:
                return None
            learned = self.active(current.policy, router)
            ladder = tiers(current.policy)
            policy, note = await anyio.to_thread.run_sync(self._learn, tenant, current.policy, router, ladder, learned)
            if policy is None:
                return None
            version = await anyio.to_thread.run_sync(lambda: store.save(tenant_id, policy, ACTOR, note, ACTION))
            log.warning("tenant %s's routing learned from its verdicts (policy v%d): %s", tenant, version, note)
            return Versioned(version, policy, note, ACTOR)

    def _learn(
        self, tenant: str, policy: Policy, router: str, ladder: Sequence[str], learned: LearnedRouting | None
    ) -> tuple[Policy | None, str]:
        settings = policy.router
        identities = self.of(policy)
        cells = self.verdicts.cells(tenant, identities, router, since=settings.learn_since)
        seen, went_large = list(self._seen[tenant]), list(self._large[tenant])
        before = sum(went_large) / len(went_large)
        found = learn_threshold(seen, cells, settings.quality_ratio, ladder, LARGE)
        total = self.verdicts.count(tenant, identities, router, since=settings.learn_since)
        if found is None:
            if learned is None:
                return None, ""
            note = (
                f"no threshold keeps the floor {settings.quality_ratio} on {total} verdicts: the learned routing goes"
            )
            return _with(policy, None), note
        if learned is None and found.large_share >= before - 0.005:
            return None, ""  # the shipped routing is as cheap: nothing to move toward small
        made = LearnedRouting(
            router=router, threshold=round(found.threshold, 6),
            identities={t: identities[t] for t in ladder if t != LARGE and t in identities},
            cells={cell: dict(tiers) for cell, tiers in sorted(cells.items())}, verdicts=total,
            shadow_judged=self.shadow.judged(tenant), ratio=round(min(1.0, found.ratio), 4),
            low=round(max(-1.0, found.low), 4), large_share=round(found.large_share, 4),
            large_share_before=round(before, 4), prompts=found.prompts, made=time.time(),
        )  # fmt: skip
        way = "toward small" if found.large_share < before else "toward large"
        note = (
            f"learned from {total} verdicts in {len(cells)} cells ({way}): estimated quality {found.ratio:.3f} "
            f"(95% low {found.low:.3f}) over the floor {settings.quality_ratio} on {found.prompts} recent prompts, "
            f"large share {before:.3f} -> {found.large_share:.3f}"
        )
        return _with(policy, made), note

    async def reset(self, tenant_id: int, actor: str) -> Versioned:
        """Forget what the tenant's verdicts taught: no learned routing, and none learned from before now."""
        assert self.policies is not None
        store = self.policies
        current = await anyio.to_thread.run_sync(store.current, tenant_id)
        policy = _with(current.policy, None, learn_since=time.time())
        note = "the routing learned from this tenant's verdicts was reset"
        version = await anyio.to_thread.run_sync(lambda: store.save(tenant_id, policy, actor, note, ACTION_RESET))
        return Versioned(version, policy, note, actor)

    def summary(self, tenant: str, policy: Policy, router: str, ladder: Sequence[str]) -> dict[str, Any]:
        """What `GET /v1/admin/router` and the console show of the tenant's learning: whether its learned routing
        applies, what it was learned from, the curve on its mix now, and what its verdicts cost."""
        settings = policy.router
        learned = self.active(policy, router)
        cells = self.verdicts.cells(tenant, self.of(policy), router, since=settings.learn_since)
        seen = list(self._seen.get(tenant, ()))
        curve = tenant_curve(seen, cells, settings.quality_ratio, ladder, LARGE) if len(seen) >= MIN_SEEN else None
        spend = self.verdicts.spend(tenant)
        return {
            "learn": settings.learn,
            "active": learned is not None,
            "threshold": learned.threshold if learned is not None else None,
            "learned": learned.model_dump(mode="json", exclude={"cells"}) if learned is not None else None,
            "verdicts": self.verdicts.count(tenant, self.of(policy), router, since=settings.learn_since),
            "fresh": self.fresh(tenant, policy, router),
            "cells": {cell: {t: list(c) for t, c in tiers.items()} for cell, tiers in sorted(cells.items())},
            "curve": [list(p) for p in curve.points] if curve is not None else [],  # (threshold, large share, ratio)
            "curve_threshold": curve.threshold if curve is not None else None,  # what a learning now would pick
            "prompts": len(seen),
            **{d: {"runs": spend.get(d, (0, 0))[0], "cost_usd": str(spend.get(d, (0, 0))[1])}
               for d in ("shadow", "explore")},
        }  # fmt: skip


def _with(policy: Policy, learned: LearnedRouting | None, **more: float) -> Policy:
    body = policy.model_dump(mode="json")
    body["router"]["learned"] = learned.model_dump(mode="json") if learned is not None else None
    body["router"].update(more)
    return Policy.model_validate(body)
