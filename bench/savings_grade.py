"""`bench.savings`' grading, and its cross-check of the finance API against prices × usage.

Grading: GSM8K by the exact final number, HumanEval by its unit tests in `grading.sandbox`, short facts by
containment (`grading.facts.grade_fact`); open chat (MT-bench, chats) as `switchboard router label`
grades it: the always-large answer is the reference and counts as right, and another answer is right when
the large tier, judging with `grading.graders.judge_messages`, says it is as good (identical answers need no
judge). A request that failed is wrong in its run; a chat whose always-large answer failed has no reference
and is left out of both runs' accuracy.

Cross-check, per tenant: `GET /v1/finance/savings` (from the daily rollup) against the raw ledger rows'
sums (cost, counterfactual, every lever), the cost against each row's tokens × its tier's prices in the
tenant's policy (a response-cache hit costs nothing), and counterfactual − cost against the levers' sum.
A relative difference above `TOLERANCE` is a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from decimal import Decimal
from typing import Any

import httpx

from bench.savings_trace import Request
from grading.facts import grade_fact

TOLERANCE = 1e-6
LEVERS = ("cache", "routing", "speculation", "verifier", "policy")
AMOUNTS = ("cost", "counterfactual_cost", *(f"saved_{lv}" for lv in LEVERS))
CHAT_SOURCES = ("mtbench", "chat")

Judge = Callable[[list[list[dict[str, str]]]], list[str | None]]


def _grade_one(request: Request, text: str) -> bool:
    from grading.graders import grade_gsm8k, grade_humaneval

    if request.source == "gsm8k":
        return grade_gsm8k(request.item(), text)
    if request.source == "humaneval":
        return grade_humaneval(request.item(), text)
    if request.source == "fact":
        return grade_fact(request.grading, text)
    raise ValueError(f"{request.source} answers are judged, not graded")


def grade_references(trace: Sequence[Request], runs: dict[str, list[dict]], workers: int) -> dict[str, list]:
    """Per run, per request: True/False for gradable sources, None (still to judge) for open chat."""
    grades: dict[str, list[bool | None]] = {run: [None] * len(trace) for run in runs}
    jobs: dict[tuple[str, str], list[tuple[str, int]]] = {}  # (item, text) → where it goes: graded once
    for run, rows in runs.items():
        for r in trace:
            row = rows[r.index]
            if not row.get("ok"):
                grades[run][r.index] = False
            elif r.source not in CHAT_SOURCES:
                jobs.setdefault((r.item_id, row["text"]), []).append((run, r.index))
    by_id = {r.item_id: r for r in trace}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        futures = {k: pool.submit(_grade_one, by_id[k[0]], k[1]) for k in jobs}
        for k, future in futures.items():
            for run, i in jobs[k]:
                grades[run][i] = future.result()
    return grades


def judge_chats(trace: Sequence[Request], large: list[dict], auto: list[dict], grades: dict[str, list],
                judge: Judge, run: str = "auto") -> dict[str, int]:  # fmt: skip
    """Fill in open chat: always-large right when answered; `run`'s answers (`auto`) right when identical or
    judged as good."""
    from grading.graders import judge_messages, parse_verdict

    asks: dict[tuple[str, str, str], list[int]] = {}
    for r in trace:
        if r.source not in CHAT_SOURCES:
            continue
        ref, cand = large[r.index], auto[r.index]
        grades["large"][r.index] = True if ref.get("ok") else None  # no reference: left out of both runs
        if not ref.get("ok"):
            grades[run][r.index] = None
        elif cand.get("ok"):
            if cand["text"].strip() == ref["text"].strip():
                grades[run][r.index] = True
            else:
                asks.setdefault((r.question, ref["text"], cand["text"]), []).append(r.index)
    keys = list(asks)
    replies = judge([judge_messages(*k) for k in keys]) if keys else []
    failed = 0
    for k, reply in zip(keys, replies, strict=True):
        failed += reply is None
        for i in asks[k]:
            grades[run][i] = reply is not None and parse_verdict(reply) is True  # no clear yes: not as good
    return {"judged": len(keys), "judge_failed": failed}


# --- finance and the ledger ----------------------------------------------------------------------------


def finance_savings(url: str, key: str, start: date, end: date) -> dict[str, dict[str, Any]]:
    """`GET /v1/finance/savings` over the run's days, by tenant name; money as Decimal."""
    r = httpx.get(f"{url}/v1/finance/savings", params={"start": start.isoformat(), "end": end.isoformat()},
                  headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
    r.raise_for_status()
    out = {}
    for row in r.json()["data"]:
        out[row["tenant"]] = {k: (Decimal(v) if k in (*AMOUNTS, "saved") else v) for k, v in row.items()}
    return out


def ledger_rows(db_url: str, tenants: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """The raw usage rows of these tenants, by tenant name."""
    import sqlalchemy as sa

    from core.db.database import Database
    from core.db.models import Tenant, Usage

    db = Database(db_url)
    q = sa.select(Tenant.name, Usage).join(Tenant, Tenant.id == Usage.tenant_id).where(Tenant.name.in_(tenants))
    out: dict[str, list[dict[str, Any]]] = {t: [] for t in tenants}
    cols = [c.name for c in Usage.__table__.columns]
    try:
        with db.session() as s:
            for name, usage in s.execute(q):
                out[name].append({c: getattr(usage, c) for c in cols})
    finally:
        db.dispose()
    return out


def priced(row: dict[str, Any], policy: Any) -> Decimal:
    """A row's cost from its tokens and its tier's prices: what the gateway should have charged."""
    if "hit" in str(row["cache_status"]):
        return Decimal(0)  # answered from the response cache (or an identical request in flight): nothing ran
    p = policy.price(row["tier"])
    cached, accepted = row["cached_prompt_tokens"] or 0, row["draft_accepted"] or 0
    return (
        (row["prompt_tokens"] - cached) * p.prompt
        + cached * p.cached
        + (row["completion_tokens"] - accepted) * p.completion
        + accepted * p.drafted
    ) / Decimal(1_000_000)


def _differs(a: Decimal, b: Decimal) -> bool:
    return abs(a - b) > Decimal(str(TOLERANCE)) * max(abs(a), abs(b)) + Decimal("1e-10")


def crosscheck(finance: dict[str, dict], ledger: dict[str, list[dict]], policies: dict[str, Any]) -> list[str]:
    """Every disagreement between the finance API, the ledger and prices × tokens, one line each."""
    problems = []
    for tenant, rows in ledger.items():
        got = finance.get(tenant)
        if got is None:
            if rows:
                problems.append(f"{tenant}: {len(rows)} ledger rows, no finance row")
            continue
        if int(got["requests"]) != len(rows):
            problems.append(f"{tenant}: finance counts {got['requests']} requests, the ledger {len(rows)}")
        for amount in AMOUNTS:
            raw = sum((Decimal(r[amount]) for r in rows), Decimal(0))
            if _differs(got[amount], raw):
                problems.append(f"{tenant}: {amount} {got[amount]} from finance, {raw} summed from the ledger")
        expected = sum((priced(r, policies[tenant]) for r in rows), Decimal(0))
        if _differs(got["cost"], expected):
            problems.append(f"{tenant}: cost {got['cost']} from finance, {expected} from prices × tokens")
        levers = sum((got[f"saved_{lv}"] for lv in LEVERS), Decimal(0))
        if _differs(got["counterfactual_cost"] - got["cost"], levers):
            problems.append(f"{tenant}: counterfactual − cost = {got['counterfactual_cost'] - got['cost']}, "
                            f"the levers sum to {levers}")  # fmt: skip
    return problems


def usage_agreement(results: Sequence[dict], ledger: dict[str, list[dict]]) -> dict[str, int]:
    """Responses' usage against their ledger rows (engine-run answers only): how many agree, differ, lack a row."""
    rows = {r["request_id"]: r for tenant_rows in ledger.values() for r in tenant_rows}
    out = {"agree": 0, "differ": 0, "no_row": 0}
    for res in results:
        if not res.get("ok") or res.get("cache") != "miss":
            continue
        row = rows.get(res.get("request_id") or "")
        if row is None:
            out["no_row"] += 1
        elif (row["prompt_tokens"], row["completion_tokens"]) == (res["prompt_tokens"], res["completion_tokens"]):
            out["agree"] += 1
        else:
            out["differ"] += 1
    return out
