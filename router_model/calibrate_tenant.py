"""A tenant's own threshold, from its own routed prompts, stored as a new version of its policy.

`switchboard router calibrate --tenant NAME --large-share S` reads the tenant's newest routed
conversations (`router_model.routed_prompts`: kept only under `router.store_prompts`), picks the
threshold that sends a share S of them to the large tier, and saves the tenant's policy with
`router.mode = "large_share"`, `router.large_share = S` and `router.calibration` (threshold, the share
it sent large, how many prompts, and the router it is for): a new version and an audit row, like any
policy change, so it can be rolled back. A calibration is for one router: after a retraining the
gateway falls back to the router's global threshold until the tenant is calibrated again.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from core.db.database import Database
from core.db.models import Tenant
from policies.policy import Policy, RouterCalibration
from policies.store import PolicyStore
from router_model.calibrate import MIN_TENANT_PROMPTS, large_share, threshold_for_share
from router_model.model import Router
from router_model.routed_prompts import KEEP_PER_TENANT, RoutedPromptStore


class CalibrationError(ValueError):
    """The tenant cannot be calibrated as asked; the message says why."""


@dataclass(frozen=True)
class TenantCalibration:
    tenant: str
    version: int  # the policy version written
    calibration: RouterCalibration


def calibrate_tenant(
    db: Database,
    router: Router,
    tenant: str,
    target_share: float,
    *,
    limit: int = KEEP_PER_TENANT,
    min_prompts: int = MIN_TENANT_PROMPTS,
    actor: str = "cli",
) -> TenantCalibration:
    with db.session() as s:
        found = s.scalar(select(Tenant).where(Tenant.name == tenant))
    if found is None:
        raise CalibrationError(f"no tenant named {tenant!r}")
    conversations = RoutedPromptStore(db).recent(found.id, limit)
    if len(conversations) < min_prompts:
        raise CalibrationError(
            f"tenant {tenant} has {len(conversations)} routed prompts stored, too few for a threshold of its own "
            f"(at least {min_prompts}; its policy needs router.store_prompts = true to keep them)"
        )
    p = router.p_small_ok(conversations)
    threshold = threshold_for_share(p, target_share)
    calibration = RouterCalibration(
        threshold=threshold, large_share=large_share(p, threshold), prompts=len(conversations), router=router.id
    )
    store = PolicyStore(db)
    policy = store.current(found.id).policy
    settings = policy.router.model_copy(
        update={"mode": "large_share", "large_share": target_share, "calibration": calibration}
    )
    note = f"router calibrated: large share {target_share} on {len(conversations)} routed prompts"
    updated = Policy.model_validate(policy.model_copy(update={"router": settings}).model_dump(mode="json"))
    version = store.save(found.id, updated, actor, note)
    return TenantCalibration(tenant, version, calibration)
