"""A tenant's policy when its adapters change: a tier's default adapter is what that tenant's tier *is*, so the
routing it learned from verdicts on the tier before (`gateway.routing.learning`) is forgotten in the same policy
version that changes it, and learning starts again from the verdicts on the new one.

Verdicts record the adapter's name with the tier's identity, so a new default name alone already keeps old
verdicts out; replacing the files under the same name does not change the name, hence the reset here too."""

from __future__ import annotations

import time

from policies.policy import Policy
from policies.store import PolicyStore

__all__ = ["forget_learning_if_default", "serve_by_default"]

RESET_ACTION = "policy.reset_learning"  # as gateway.routing.learning's reset is audited


def _restarted(policy: Policy, **changes: object) -> Policy:
    body = policy.model_dump(mode="json")
    body["router"]["learned"] = None
    body["router"]["learn_since"] = time.time()
    body.update(changes)
    return Policy.model_validate(body)


def serve_by_default(policies: PolicyStore, tenant_id: int, tier: str, name: str, actor: str, note: str) -> int:
    """A new version whose `tier` runs under adapter `name` by default, learning restarted; its number."""
    current = policies.current(tenant_id).policy
    policy = _restarted(current, adapters={**current.adapters, tier: name})
    return policies.save(tenant_id, policy, actor, note)


def forget_learning_if_default(policies: PolicyStore, tenant_id: int, tier: str, name: str, actor: str) -> int | None:
    """After `tier:name`'s files were replaced: where the policy serves it by default, a version with learning
    restarted (its number); else None."""
    current = policies.current(tenant_id).policy
    if current.adapters.get(tier) != name:
        return None
    note = f"adapter {tier}:{name} was replaced: the routing learned on the old one is forgotten"
    return policies.save(tenant_id, _restarted(current), actor, note, RESET_ACTION)
