"""The prompts a tuning replays: a tenant's stored conversations, or a data set the registry ships.

A tenant's prompts are those the gateway kept (`router.store_prompts`), each on the tier it was routed
to, graded by the judge (there is no reference answer for a tenant's traffic). A shipped data set
(`gsm8k`, `humaneval`, `mtbench`, `chat`) is graded by its own check where it has one.
"""

from __future__ import annotations

import random
from pathlib import Path

from sqlalchemy import select

from core.db.database import Database
from core.db.models import RoutedPrompt
from policies.tuning import TunePrompt, TuningError

DATASETS = ("gsm8k", "humaneval", "mtbench", "chat")
CHECKED = ("gsm8k", "humaneval")  # data sets with a check of their own; the rest go to the judge
RECENT = 5000  # a tenant's sample is drawn from its most recent stored prompts


def dataset_prompts(home: Path, name: str, n: int, tier: str, seed: int = 0) -> list[TunePrompt]:
    from grading.datasets import load_items

    if name not in DATASETS:
        raise TuningError(f"unknown data set {name!r}; the data sets are {', '.join(DATASETS)}")
    items = load_items(home, [name], per_source=n, seed=seed)
    grader = name if name in CHECKED else "judge"
    return [TunePrompt(i.id, i.messages, tier, grader, i.grading) for i in items]


def tenant_prompts(db: Database, tenant_id: int, n: int, served: list[str], seed: int = 0) -> list[TunePrompt]:
    """A seeded sample of the tenant's stored prompts, on tiers this gateway still serves."""
    with db.session() as s:
        rows = list(
            s.execute(
                select(RoutedPrompt.id, RoutedPrompt.messages, RoutedPrompt.tier)
                .where(RoutedPrompt.tenant_id == tenant_id)
                .order_by(RoutedPrompt.id.desc())
                .limit(RECENT)
            )
        )
    rows = [r for r in rows if r.tier in served and _chat(r.messages)]
    if not rows:
        raise TuningError(
            "this tenant has no stored prompts to tune on (its policy needs router.store_prompts); "
            "use a shipped data set instead (--dataset)"
        )
    picked = random.Random(seed).sample(rows, min(n, len(rows)))
    return [TunePrompt(f"tenant/{r.id}", r.messages, r.tier, "judge") for r in picked]


def _chat(messages: object) -> bool:
    """Stored conversations are chat messages; anything else (a malformed row) is skipped."""
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in messages)
    )
