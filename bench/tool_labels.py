"""Tool-call labels for the router: BFCL's curated questions through each tier of a live gateway, graded by BFCL's
own checker, as rows of the shipped label file, so that `auto` has verdicts for requests with tools.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.tool_labels [--per-category 60] [--out LABELS]

The questions: `bench.bfcl.CATEGORIES`, a fixed random sample of `--per-category` each, never one of the questions
`python -m bench.tools` scores (its default sample), so that benchmark stays held out from the router. Each goes to
the default profile's `tiny`, `small` and `large` by name, with its tools as BFCL's OpenAI handler converts them,
`tool_choice: auto`, greedy, through the same gateway code a tenant's request takes (the tool grammar and parsers
included: `bench.tools.run_gateway`); each answer is right or wrong by `bench.bfcl.correct` (irrelevance: no call).
Unlike open chat, the large answer is graded too, so `large_ok` can be false.

A row (`router_model.label`'s format): id `bfcl/<BFCL id>`, source `bfcl_<category>`, `<tier>_ok`, label
(= small_ok), `<tier>_model`, `needs_call` (false for irrelevance: a right answer calls nothing), and `messages`:
the conversation as the router reads it at serving time (the gateway's tools note,
`gateway.tool_calls.routing_turns`, then the question's turns), so the label file needs no dataset to be read.
Answers are kept under `--work` as they come (a rerun continues); rows already in `--out` are kept, and only
questions without a row are labeled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

from bench import bfcl
from bench.common import THREADS, say
from bench.tools import decoded, run_gateway

TIERS = ("tiny", "small", "large")
BENCH_PER_CATEGORY = 40  # `bench.tools`' default sample, left out of the labels
ID_PREFIX = "bfcl/"


def label_questions(per_category: int, seed: int = 0) -> list[bfcl.Question]:
    """`per_category` questions of each category (all that remain, if fewer), none of them in `bench.tools`'
    default sample; a fixed sample, so a rerun labels the same ones."""
    out = []
    for category in bfcl.CATEGORIES:
        held = {q.id for q in bfcl.questions(category, BENCH_PER_CATEGORY)}
        rest = [q for q in bfcl.questions(category, None) if q.id not in held]
        out += random.Random(f"labels-{seed}-{category}").sample(rest, min(per_category, len(rest)))
    return out


def routed_messages(q: bfcl.Question) -> list[dict[str, Any]]:
    """The conversation the router reads for this question (as `gateway.pipeline.admission` builds it)."""
    from gateway.tool_calls import ToolRequest, routing_turns

    tools = ToolRequest(tuple(bfcl.openai_tools(q.functions)), "auto", True)
    return [*routing_turns(tools), *({"role": m["role"], "content": m["content"]} for m in q.messages)]


def label_row(q: bfcl.Question, answers: dict[str, dict], models: dict[str, str]) -> dict[str, Any]:
    """The question's label row from each tier's recorded answer (a failed request is a wrong answer)."""
    row: dict[str, Any] = {"id": ID_PREFIX + q.id, "source": f"bfcl_{q.category}"}
    for tier in TIERS:
        answer = answers[tier]
        calls = decoded(answer.get("calls") or []) if answer.get("status") == 200 else None
        row[f"{tier}_ok"] = calls is not None and bfcl.correct(q, calls)
        row[f"{tier}_calls"] = len(answer.get("calls") or [])
        row[f"{tier}_model"] = models[tier]
    row["label"] = row["small_ok"]
    row["needs_call"] = q.category != "irrelevance"  # the floor is kept on each group (`router_model.floor`)
    row["messages"] = routed_messages(q)
    return row


def tier_models() -> dict[str, str]:
    """What each tier of the default profile is (`router_model.label.tier_model`: model@weights/dtype)."""
    from core.settings import PROFILES, TierSettings
    from router_model.label import tier_model

    return {t: tier_model(TierSettings(**PROFILES["default"][t])) for t in TIERS}


def _kept_ids(out: Path) -> set[str]:
    from router_model.label_store import read_rows

    return {str(r["id"]) for r in read_rows(out)} if out.exists() else set()


def main() -> int:
    from router_model.label import SHIPPED_LABELS

    ap = argparse.ArgumentParser(prog="python -m bench.tool_labels", description=__doc__.splitlines()[0])
    ap.add_argument("--per-category", type=int, default=60)
    ap.add_argument("--out", type=Path, default=SHIPPED_LABELS, help="the label file the rows are appended to")
    ap.add_argument("--work", type=Path, default=Path("bench/results/tool-labels"), help="answers as they come")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--home", type=Path, default=Path("~/.cache/switchboard").expanduser())
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    kept = _kept_ids(args.out)
    qs = [q for q in label_questions(args.per_category) if ID_PREFIX + q.id not in kept]
    say(f"{len(qs)} BFCL questions to label ({len(kept)} rows in {args.out}), {THREADS} threads")
    if not qs:
        return 0
    from bench.gateway_run import gateway

    with gateway(args.home, args.work, THREADS) as (url, key, _):
        for tier in TIERS:
            asyncio.run(run_gateway(url, key, tier, qs, args.work / f"answers-{tier}.jsonl", args.concurrency))
    answers = {t: _answers(args.work / f"answers-{t}.jsonl") for t in TIERS}
    models = tier_models()
    rows = [label_row(q, {t: answers[t][q.id] for t in TIERS}, models) for q in qs]
    with args.out.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    print(json.dumps(summary(rows)))
    return 0


def _answers(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per source: rows and each tier's right share."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["source"], []).append(r)
        by.setdefault("all", []).append(r)
    return {s: {"n": len(g), **{f"{t}_ok": round(sum(r[f"{t}_ok"] for r in g) / len(g), 3) for t in TIERS}}
            for s, g in by.items()}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
