"""A tenant's quality floor on its own traffic: the estimate against always-large, and the recalibration
toward large when the estimate shows the floor is not kept.

    served     every routed request's serving tier, per tenant (the last 1,000): the shares c_t
    estimate   `router_model.quality.estimate` on those shares and the tenant's shadow verdicts since its
               last recalibration (`gateway.routing.shadow` judges a sample of tiny- and small-served answers)
    check      after each new verdict, for a tenant in mode `quality_ratio`: where the estimate's 95%
               upper end is below the floor on at least 30 fresh verdicts, a new policy version aims the
               held-out curve higher by the shortfall (`router.recalibration`), saved and audited as
               `policy.recalibrate` by `switchboard`, with the estimate that triggered it

The routing stage owns one; `GET /v1/admin/router` and the console read the estimate from it.
"""

from __future__ import annotations

import asyncio
import logging

import anyio

from policies.policy import FloorRecalibration, Policy, RouterSettings
from policies.store import PolicyStore, Versioned
from router_model.model import LARGE
from router_model.quality import QualityEstimate, ServedTiers, TenantVerdicts, estimate, recalibrated_offset

log = logging.getLogger(__name__)


def estimate_since(router: RouterSettings) -> int:
    """The tenant's shadow verdicts before its estimate's start: its last recalibration toward large, or its last
    learned routing (`gateway.routing.learning`), whichever came later; the estimate and the warm-up count
    only what came after."""
    recalibrated = router.recalibration.judged if router.recalibration is not None else 0
    learned = router.learned.shadow_judged if router.learned is not None else 0
    return max(recalibrated, learned)


ACTOR = "switchboard"  # who the audit log says changed the policy
ACTION = "policy.recalibrate"


class QualityFloor:
    def __init__(self, verdicts: TenantVerdicts, policies: PolicyStore | None = None) -> None:
        self.verdicts = verdicts
        self.policies = policies
        self.served = ServedTiers()
        self._lock = asyncio.Lock()  # one recalibration at a time: two verdicts must not both raise the aim
        self.policies_seen: dict[str, Policy] = {}  # tenant → the policy its last routed request ran under

    def add(self, tenant: str, tier: str, policy: Policy) -> None:
        """A routed request of `tenant` went to `tier` under `policy`."""
        self.served.add(tenant, tier)
        self.policies_seen[tenant] = policy

    def estimate(self, tenant: str, policy: Policy | None = None) -> QualityEstimate | None:
        """The tenant's quality against always-large under its policy (default: the one its last routed
        request ran under), on its verdicts since its last recalibration; None before its first routed
        request or first verdict."""
        shares = self.served.shares(tenant)
        seen = self.policies_seen.get(tenant)
        router = policy.router if policy is not None else seen.router if seen is not None else None
        if not shares or router is None:
            return None
        since = estimate_since(router)
        cheaper = {tier: share for tier, share in shares.items() if tier != LARGE}
        return estimate(cheaper, self.verdicts.counts(tenant, since))

    def summary(self, tenant: str) -> dict[str, object] | None:
        """What `GET /v1/admin/router` and the console show: the estimate beside the floor it is held to."""
        seen = self.policies_seen.get(tenant)
        if seen is None:
            return None
        router = seen.router
        found = self.estimate(tenant)
        floor = router.quality_ratio if router.mode == "quality_ratio" else None
        out: dict[str, object] = {"floor": floor, "aimed_at": router.floor if floor is not None else None}
        out["estimate"] = None if found is None else found.as_dict()
        out["short"] = None if found is None or floor is None else found.high < floor  # the floor is measured not kept
        out["recalibration"] = router.recalibration.model_dump() if router.recalibration is not None else None
        return out

    async def check(self, tenant_id: int, tenant: str) -> Versioned | None:
        """After a new verdict: recalibrate the tenant toward large if its floor is measured short (see the
        module's docstring); the new policy version, or None."""
        if self.policies is None:
            return None
        async with self._lock:
            current = await anyio.to_thread.run_sync(self.policies.current, tenant_id)
            router = current.policy.router
            if router.mode != "quality_ratio":
                return None
            found = self.estimate(tenant, current.policy)
            before = router.recalibration.offset if router.recalibration is not None else 0.0
            offset = recalibrated_offset(found, router.quality_ratio, before)
            if offset is None or found is None:
                return None
            recalibration = FloorRecalibration(
                offset=round(offset, 4), judged=self.verdicts.judged(tenant),
                ratio=round(found.ratio, 4), high=round(found.high, 4),
            )  # fmt: skip
            body = current.policy.model_dump(mode="json")
            body["router"]["recalibration"] = recalibration.model_dump(mode="json")
            body["router"]["learned"] = None  # routing learned on verdicts the estimate now finds short goes too
            policy = Policy.model_validate(body)
            note = (
                f"estimated quality {found.ratio:.3f} (95% CI {found.low:.3f}-{found.high:.3f}, {found.judged} "
                f"verdicts) below the floor {router.quality_ratio}: aiming at {router.quality_ratio + offset:.3f}"
            )
            store = self.policies
            version = await anyio.to_thread.run_sync(lambda: store.save(tenant_id, policy, ACTOR, note, ACTION))
            log.warning("tenant %s recalibrated toward large (policy v%d): %s", tenant, version, note)
            self.policies_seen[tenant] = policy
            return Versioned(version, policy, note, ACTOR)
