"""The ledger's row: one request's usage, priced, as `gateway.accounting.ledger` stores it and its spool keeps it.

In memory a record is small groups (tokens, decisions, the charge); on disk it is the flat row of the
`usage` table, whose column order the spool's JSON lines keep (`as_row`, `to_json`, `from_columns`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from core.db.models import utcnow
from core.money import ZERO
from policies.pricing import Charge

COUNTS = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "draft_proposed", "draft_accepted")
AMOUNTS = (
    "cost",
    "counterfactual_cost",
    "saved_cache",
    "saved_routing",
    "saved_speculation",
    "saved_verifier",
    "saved_policy",
)


# The usage row's columns, in the row's (and the spool's JSON) order.
COLUMNS = (
    "request_id",
    "tenant_id",
    "api_key_id",
    "endpoint",
    "model",
    "tier",
    "prompt_tokens",
    "completion_tokens",
    "latency_ms",
    "status",
    "finish_reason",
    "cached_prompt_tokens",
    "draft_proposed",
    "draft_accepted",
    "requested_max_tokens",
    "effective_max_tokens",
    "cache_status",
    "route",
    "verifier_actions",
    "policy_version",
    *AMOUNTS,
    "created_at",
    "requested_model",
)


@dataclass(frozen=True)
class TokenCounts:
    """The row's token columns: what ran, and the completion limit it ran under."""

    prompt: int
    completion: int
    cached_prompt: int = 0  # found in the KV prefix cache
    draft_proposed: int = 0
    draft_accepted: int = 0
    requested_max: int | None = None  # max tokens as the client sent them
    effective_max: int = 0  # after the policy's cap


@dataclass(frozen=True)
class Decisions:
    """What the gateway decided for the request: its cache status, how its tier was chosen, under which
    policy version, and what the verifiers did."""

    cache_status: str = "miss"  # hit | semantic-hit | miss | bypass | flight-hit | flight-sem-hit (single flight)
    route: str = "direct"  # direct | auto | shadow
    policy_version: int = 0
    verifier_actions: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class UsageRecord:
    """One ledger row. Its flat form (`as_row`, `from_columns`) is the SQL row and the spool's JSON line."""

    request_id: str
    tenant_id: int
    api_key_id: int | None
    endpoint: str
    model: str  # the checkpoint that served
    tier: str
    latency_ms: int
    status: str  # ok | aborted | error | escalated
    finish_reason: str | None
    tokens: TokenCounts
    decisions: Decisions = field(default_factory=Decisions)
    charge: Charge = field(default_factory=lambda: Charge(cost=ZERO, counterfactual=ZERO))
    created_at: datetime = field(default_factory=utcnow)
    requested_model: str | None = None  # the name the client sent, where an alias (or `auto`) named the tier

    @classmethod
    def from_columns(cls, *values: Any, **named: Any) -> UsageRecord:
        """A record from its columns, positionally in `COLUMNS` order and/or by name; columns left out take
        their defaults (those of the `usage` table)."""
        if len(values) > len(COLUMNS):
            raise TypeError(f"a usage row has {len(COLUMNS)} columns, not {len(values)}")
        c = dict(zip(COLUMNS, values, strict=False))
        if twice := c.keys() & named.keys():
            raise TypeError(f"columns given twice: {', '.join(sorted(twice))}")
        c |= named
        tokens = TokenCounts(
            prompt=c.pop("prompt_tokens"),
            completion=c.pop("completion_tokens"),
            cached_prompt=c.pop("cached_prompt_tokens", 0),
            draft_proposed=c.pop("draft_proposed", 0),
            draft_accepted=c.pop("draft_accepted", 0),
            requested_max=c.pop("requested_max_tokens", None),
            effective_max=c.pop("effective_max_tokens", 0),
        )
        decisions = Decisions(
            cache_status=c.pop("cache_status", "miss"),
            route=c.pop("route", "direct"),
            policy_version=c.pop("policy_version", 0),
            verifier_actions=c.pop("verifier_actions") if "verifier_actions" in c else [],
        )
        charge = Charge(
            cost=c.pop("cost", ZERO),
            counterfactual=c.pop("counterfactual_cost", ZERO),
            saved_routing=c.pop("saved_routing", ZERO),
            saved_cache=c.pop("saved_cache", ZERO),
            saved_speculation=c.pop("saved_speculation", ZERO),
            saved_policy=c.pop("saved_policy", ZERO),
            saved_verifier=c.pop("saved_verifier", ZERO),
        )
        return cls(**c, tokens=tokens, decisions=decisions, charge=charge)

    def as_row(self) -> dict[str, Any]:
        """The flat row, in `COLUMNS` order: what the `usage` table stores and the spool writes."""
        t, d = self.tokens, self.decisions
        return {
            "request_id": self.request_id,
            "tenant_id": self.tenant_id,
            "api_key_id": self.api_key_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "tier": self.tier,
            "prompt_tokens": t.prompt,
            "completion_tokens": t.completion,
            "latency_ms": self.latency_ms,
            "status": self.status,
            "finish_reason": self.finish_reason,
            "cached_prompt_tokens": t.cached_prompt,
            "draft_proposed": t.draft_proposed,
            "draft_accepted": t.draft_accepted,
            "requested_max_tokens": t.requested_max,
            "effective_max_tokens": t.effective_max,
            "cache_status": d.cache_status,
            "route": d.route,
            "verifier_actions": [dict(a) for a in d.verifier_actions],
            "policy_version": d.policy_version,
            **self.charge.ledger_fields(),
            "created_at": self.created_at,
            "requested_model": self.requested_model,
        }

    def to_json(self) -> str:
        """The spool's line: the flat row as JSON (amounts as decimal strings, the time in ISO 8601)."""
        d = self.as_row()
        d["created_at"] = self.created_at.isoformat()
        return json.dumps(d, default=str)

    @classmethod
    def from_json(cls, line: str) -> UsageRecord:
        d: dict[str, Any] = json.loads(line)
        d["created_at"] = datetime.fromisoformat(d["created_at"])
        for name in AMOUNTS:
            d[name] = Decimal(d[name])
        return cls.from_columns(**d)

    # Single columns by their ledger names, for readers of a few (the metrics).

    @property
    def prompt_tokens(self) -> int:
        return self.tokens.prompt

    @property
    def completion_tokens(self) -> int:
        return self.tokens.completion

    @property
    def cached_prompt_tokens(self) -> int:
        return self.tokens.cached_prompt

    @property
    def draft_proposed(self) -> int:
        return self.tokens.draft_proposed

    @property
    def draft_accepted(self) -> int:
        return self.tokens.draft_accepted

    @property
    def cache_status(self) -> str:
        return self.decisions.cache_status

    @property
    def route(self) -> str:
        return self.decisions.route

    @property
    def cost(self) -> Decimal:
        return self.charge.cost

    @property
    def counterfactual_cost(self) -> Decimal:
        return self.charge.counterfactual
