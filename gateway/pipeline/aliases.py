"""Model aliases: the names apps hard-code (`gpt-4o-mini`, `text-embedding-3-small`, a Claude id) → the tier,
`auto` or embedding model that serves them, so an app changes only its base URL. A tenant's policy `aliases` come
first, then the operator's `model_aliases` setting; any other name is itself. Responses keep the name asked for;
the ledger keeps it beside the tier that served (`requested_model`)."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.routing.stage import AUTO
from policies.policy import Policy

__all__ = ["ALIAS_TARGETS", "EMBEDDING_TIER", "aliases", "resolve"]

EMBEDDING_TIER = "minilm"  # the in-process embedder's tier: its price, its ledger rows
ALIAS_TARGETS = (AUTO, EMBEDDING_TIER)  # what an alias may name besides the served tiers


def aliases(policy: Policy, operator: Mapping[str, str]) -> dict[str, str]:
    """Every alias a tenant's key may call, the tenant's own over the operator's."""
    return {**operator, **policy.aliases}


def resolve(policy: Policy, operator: Mapping[str, str], name: str) -> str:
    return policy.aliases.get(name) or operator.get(name) or name
