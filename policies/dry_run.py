"""What a new policy would have done to a tenant's recent requests, replayed from the ledger.

For each request, oldest first: whether the new policy would have refused it (tier not allowed, a
rate limit, a hard budget given everything it let through before), how many completion tokens its
cap would have allowed, and its cost at the new prices. Token counts are the ledger's: a request
the new cap would have cut is assumed to stop at the cap.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from core.db.models import Usage
from policies.policy import Policy
from policies.pricing import Tokens, charge


@dataclass
class Change:
    request_id: str
    created_at: datetime
    tier: str
    outcome: str  # same | clamped | refused: tier | refused: budget | refused: rate limit
    cost_before: Decimal
    cost_after: Decimal
    completion_before: int
    completion_after: int


@dataclass
class DryRun:
    requests: int = 0
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    clamped: int = 0
    cost_before: Decimal = Decimal(0)
    cost_after: Decimal = Decimal(0)
    by_tier_before: dict[str, Decimal] = field(default_factory=lambda: defaultdict(Decimal))
    by_tier_after: dict[str, Decimal] = field(default_factory=lambda: defaultdict(Decimal))
    changes: list[Change] = field(default_factory=list)  # requests whose outcome or cost would change

    def as_dict(self, max_changes: int = 50) -> dict:
        return {
            "requests": self.requests,
            "refused": dict(self.refused),
            "clamped": self.clamped,
            "cost_before": str(self.cost_before),
            "cost_after": str(self.cost_after),
            "by_tier_before": {k: str(v) for k, v in self.by_tier_before.items()},
            "by_tier_after": {k: str(v) for k, v in self.by_tier_after.items()},
            "changes": [
                {**c.__dict__, "created_at": c.created_at.isoformat(), "cost_before": str(c.cost_before),
                 "cost_after": str(c.cost_after)}
                for c in self.changes[:max_changes]
            ],
        }  # fmt: skip


def replay(policy: Policy, rows: list[Usage]) -> DryRun:
    """`rows`: the tenant's ledger rows, any order."""
    out = DryRun()
    spent: dict[tuple[str, str], list] = defaultdict(lambda: [Decimal(0), 0])  # (period, window) → money, tokens
    per_minute: dict[tuple[str, object, int], list[int]] = defaultdict(lambda: [0, 0])
    budgets = {b.period: b for b in policy.budgets if b.hard}
    rl = policy.rate_limits
    for row in sorted(rows, key=lambda r: r.created_at):
        out.requests += 1
        out.cost_before += row.cost
        out.by_tier_before[row.tier] += row.cost
        completion = row.completion_tokens
        cap = policy.sampling.max_tokens_cap
        if cap is not None and row.effective_max_tokens and completion > cap:
            completion = cap
        tokens = Tokens(
            prompt=row.prompt_tokens,
            completion=completion,
            cached_prompt=row.cached_prompt_tokens,
            draft_accepted=min(row.draft_accepted, completion),
        )
        cost = charge(policy, row.tier, tokens).cost
        outcome = "clamped" if completion < row.completion_tokens else "same"
        minute = int(row.created_at.timestamp() // 60)
        used = row.prompt_tokens + completion
        windows = {"daily": row.created_at.strftime("%Y-%m-%d"), "monthly": row.created_at.strftime("%Y-%m")}
        if not policy.allows(row.tier):
            outcome = "refused: tier"
        elif any(
            (lim is not None and per_minute[(scope, ident, minute)][i] + amount > lim)
            for scope, ident, lims in (("key", row.api_key_id, (rl.key_rpm, rl.key_tpm)),
                                       ("tenant", row.tenant_id, (rl.tenant_rpm, rl.tenant_tpm)))
            for i, (lim, amount) in enumerate(zip(lims, (1, used), strict=True))
        ):  # fmt: skip
            outcome = "refused: rate limit"
        else:
            for period, b in budgets.items():
                money, toks = spent[(period, windows[period])]
                if (b.money is not None and money + cost > b.money) or (
                    b.tokens is not None and toks + used > b.tokens
                ):
                    outcome = "refused: budget"
        if outcome.startswith("refused"):
            out.refused[outcome.split(": ")[1]] += 1
            cost, completion = Decimal(0), 0
        else:
            for period in ("daily", "monthly"):
                spent[(period, windows[period])][0] += cost
                spent[(period, windows[period])][1] += used
            for scope, ident in (("key", row.api_key_id), ("tenant", row.tenant_id)):
                per_minute[(scope, ident, minute)][0] += 1
                per_minute[(scope, ident, minute)][1] += used
            out.clamped += outcome == "clamped"
        out.cost_after += cost
        out.by_tier_after[row.tier] += cost
        if outcome != "same" or cost != row.cost:
            out.changes.append(
                Change(
                    row.request_id, row.created_at, row.tier, outcome, row.cost, cost, row.completion_tokens, completion
                )
            )
    return out
