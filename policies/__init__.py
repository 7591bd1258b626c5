"""Tenant policies as data, and what enforces them before and after a request runs.

- `policy`: the versioned policy model (tiers, sampling caps and defaults, budgets, router, verifiers, cache).
- `store`, `proposals`: policies and tuning proposals in SQL, every change audited.
- `budgets`, `counters`: worst-case reservations on Redis counters, settled after the request; refusals are
  domain errors (`BudgetExceeded`, `RateLimited`, `CountersUnavailable`) the gateway maps to HTTP.
- `pricing`, `sampling`, `dry_run`: what a request costs and saved, the sampling a policy resolves, replays.
- `tuning`, `tune_*`: policy tuning: candidate policies run, graded and proposed.
"""

__all__ = [
    "budgets",
    "counters",
    "dry_run",
    "policy",
    "pricing",
    "proposals",
    "sampling",
    "store",
    "tune_prompts",
    "tune_quality",
    "tune_report",
    "tune_run",
    "tuning",
]
