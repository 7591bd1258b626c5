"""`bench.savings`' learned run: three fresh tenants on the built-in default policy (which explores and learns
per tenant by itself) whose routing learns from the first half of each tenant's own traffic and is scored
on the second half, against always-large on exactly the same requests.

The split (`split_by_tenant`) is per tenant, in trace order: the first half of a tenant's requests (the
smaller half when odd) is its `learn` part, the rest its `score` part. The learn part replays (`model:
"auto"`, arrivals from its first one), then the bench waits until the gateway's background shadow and
explore runs have settled (`GET /v1/admin/router`: every tenant's `learning.verdicts` and
`quality.estimate` unchanged for 15 s, at most 900 s), replays the score part and waits again.

The finance API is per tenant and day and cannot split the halves, so the score part's cost comes from the
ledger's rows, matched to the responses by request id (`per_request`); rows whose id names a background
run (`-shadow`, `-explore...`) belong to no response and are reported apart. A gateway without the
`learning` fields in `GET /v1/admin/router` still runs the bench: what it lacks reads as null or 0.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from bench import savings_gateway as gateway
from bench.savings_gateway import ROLES, dig, say
from bench.savings_grade import AMOUNTS
from bench.savings_report import ratio, summarize
from bench.savings_trace import Request

RUN = "learned"
HALF = "(2nd half)"  # the label of the score part's rows in the tables
SETTLE_S = 900.0
BACKGROUND = re.compile(r"-(shadow|explore)")


def split_by_tenant(trace: Sequence[Request]) -> tuple[list[Request], list[Request]]:
    """(learn, score): each tenant's first half of its requests in trace order (the smaller half when odd),
    and the rest; both in trace order."""
    counts, seen = Counter(r.tenant for r in trace), Counter[str]()
    learn: list[Request] = []
    score: list[Request] = []
    for r in trace:
        (learn if seen[r.tenant] < counts[r.tenant] // 2 else score).append(r)
        seen[r.tenant] += 1
    return learn, score


def rebased(part: Sequence[Request]) -> list[Request]:
    """The part with arrivals counted from its first one: replayed alone, it starts at once."""
    t0 = min((r.at for r in part), default=0.0)
    return [replace(r, at=r.at - t0) for r in part]


def _money(value: Any) -> Decimal:
    try:
        return value if isinstance(value, Decimal) else Decimal(str(value or 0))
    except InvalidOperation:
        return Decimal(0)


def is_background(request_id: str) -> bool:
    """A ledger row of a run the gateway made on its own behind a request (a shadow or an explore run)."""
    return BACKGROUND.search(request_id) is not None


def per_request(results: Sequence[dict], rows: Sequence[dict]) -> tuple[list[dict[str, Decimal]], dict[str, Any]]:
    """Each response's ledger amounts (`AMOUNTS`, from the rows with its request id; zeros where none), in
    `results`' order, and what no response claims: background runs (rows, cost) and other unmatched rows."""
    zero = dict.fromkeys(AMOUNTS, Decimal(0))
    by_id: dict[str, dict[str, Decimal]] = {}
    background = {"rows": 0, "cost": Decimal(0)}
    for row in rows:
        rid = str(row.get("request_id") or "")
        if is_background(rid):
            background["rows"] += 1
            background["cost"] += _money(row.get("cost"))
            continue
        into = by_id.setdefault(rid, dict(zero))
        for k in AMOUNTS:
            into[k] += _money(row.get(k))
    claimed = {x.get("request_id") for x in results}
    amounts = [dict(by_id.get(x.get("request_id") or "", zero)) for x in results]
    unmatched = sum(rid not in claimed for rid in by_id)
    return amounts, {"background_rows": background["rows"], "background_cost": background["cost"],
                     "unmatched_rows": unmatched}  # fmt: skip


def part_summary(part: Sequence[Request], results: list[dict], grades: list, amounts: list[dict[str, Decimal]],
                 roles: set[str]) -> dict[str, Any]:  # fmt: skip
    """`summarize` on a part of the trace, its money summed from the ledger per request (`per_request`)."""
    mine = [r for r in part if r.tenant in roles]
    finance = {k: sum((amounts[r.index][k] for r in mine), Decimal(0)) for k in AMOUNTS}
    return summarize(part, results, grades, [finance], roles)


def half_summaries(score: Sequence[Request], runs: Sequence[str], results: dict[str, list[dict]],
                   grades: dict[str, list], amounts: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The score part's table rows, per run and tenant: label `<run> (2nd half)/<tenant>` ('' for all)."""
    out = {}
    for run in runs:
        for tenant, roles in (("", set(ROLES)), *((role, {role}) for role in ROLES)):
            out[f"{run} {HALF}/{tenant}"] = part_summary(score, results[run], grades[run], amounts[run], roles)
    return out


def score_ratios(halves: dict[str, dict[str, Any]], run: str) -> tuple[float | None, float | None]:
    """(accuracy, cost) of `run` over always-large's on the score part's requests; None where `run` is absent."""
    mine, large = halves.get(f"{run} {HALF}/"), halves[f"large {HALF}/"]
    if mine is None:
        return None, None
    return ratio(mine["accuracy"], large["accuracy"]), ratio(mine["cost"], large["cost"])


def _probe(entry: dict[str, Any]) -> tuple[Any, Any]:
    return dig(entry, "learning", "verdicts"), dig(entry, "quality", "estimate")


def replay_learned(url: str, trace: Sequence[Request], keys: dict[str, str], admin: str, names: dict[str, str],
                   record: Path, common: dict[str, Any]) -> tuple[list[dict], dict[str, Any]]:  # fmt: skip
    """The learn part, the wait for its background runs, the score part, the wait again: the records in
    trace order, and the `learning` figures (`learning_notes`). `names`: role → tenant name."""
    learn, score = split_by_tenant(trace)
    results: list[dict] = [{} for _ in trace]
    settled: list[dict[str, dict[str, Any]]] = []
    for part, desc in ((learn, f"{RUN}, 1st half"), (score, f"{RUN}, 2nd half")):
        rows = gateway.replay(url, rebased(part), keys, model="auto", no_store=False, record=record, desc=desc,
                              append=bool(settled), **common)  # fmt: skip
        for r, row in zip(part, asyncio.run(rows), strict=True):
            results[r.index] = row
        say(f"{desc}: waiting for the background shadow and explore runs to settle")
        settled.append(gateway.settle_router(url, admin, names, _probe, SETTLE_S))
    return results, learning_notes(*settled)


def learning_notes(after_learn: dict[str, dict], after_score: dict[str, dict]) -> dict[str, Any]:
    """What the gateway says it learned: per role, `active` and `threshold` after the learn part; explore runs,
    their cost and the shadow runs' cost summed over the tenants once the score part has settled."""

    def total(*keys: str) -> Decimal:
        return sum((_money(dig(e, "learning", *keys)) for e in after_score.values()), Decimal(0))

    def active(entry: dict) -> bool | None:
        found = dig(entry, "learning", "active")
        return None if found is None else bool(found)

    return {
        "active": {role: active(after_learn.get(role) or {}) for role in ROLES},
        "threshold": {role: dig(after_learn.get(role) or {}, "learning", "threshold") for role in ROLES},
        "explore_runs": int(total("explore", "runs")),
        "explore_cost_usd": float(total("explore", "cost_usd")),
        "shadow_cost_usd": float(total("shadow", "cost_usd")),
    }


def learned_keys(halves: dict[str, dict[str, Any]], runs: Sequence[str], notes: dict[str, Any],
                 background: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """The last line's `learned_*` keys and the default run's second-half ratios (nulls for a run left out)."""
    here = RUN in runs
    learned = halves.get(f"{RUN} {HALF}/")
    accuracy, cost = score_ratios(halves, RUN)
    default_accuracy, default_cost = score_ratios(halves, "default")
    bg = background or {}
    return {
        "learned_accuracy_ratio": accuracy, "learned_cost_ratio": cost,
        "learned_large_share": None if learned is None else round(learned["tiers"].get("large", 0.0), 4),
        "learned_tiers": None if learned is None else {t: round(v, 4) for t, v in learned["tiers"].items()},
        "learned_explore_runs": notes.get("explore_runs", 0) if here else None,
        "learned_explore_cost_usd": notes.get("explore_cost_usd", 0.0) if here else None,
        "learned_shadow_cost_usd": notes.get("shadow_cost_usd", 0.0) if here else None,
        "learned_active": notes.get("active") if here else None,
        "learned_threshold": notes.get("threshold") if here else None,
        "learned_background_ledger": {"rows": bg.get("background_rows", 0),
                                      "cost_usd": float(bg.get("background_cost", 0)),
                                      "unmatched_rows": bg.get("unmatched_rows", 0)} if here else None,
        "default_accuracy_ratio_second_half": default_accuracy, "default_cost_ratio_second_half": default_cost,
    }  # fmt: skip
