"""Tool calling on the Berkeley Function Calling Leaderboard: the gateway's constrained calls against the same
model unconstrained in transformers.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.tools [--per-category 40] [--tiers small large auto]

BFCL's own data and AST checker (`bench/bfcl.py`: bfcl-eval installed without its dependencies, its one module
that imports every hosted-API client stubbed) on `simple_python`, `multiple`, `parallel`, `parallel_multiple` and
`irrelevance` (a fixed random sample of `--per-category` questions each; all with `--per-category 0`). Ours: a
live `switchboard serve` (the default profile: Qwen2.5-Coder 0.5B `small` and 1.5B `large`, int8, and a router
for `auto`), each question through the OpenAI API with its tools (BFCL's OpenAI conversion), `tool_choice`
auto, greedy. The anchor: the same checkpoint in transformers (its own model class; bf16 where the CPU has AMX or
AVX-512 BF16, else fp32; `--anchor-batch` questions of similar length per left-padded `generate`), the same chat
template with the same tools, greedy and unconstrained, its output read leniently (the template's `<tool_call>` tags or,
failing those, fenced JSON blocks; any name counts as a call). Malformed calls: ours that are not JSON, name no
offered function or break its schema. Costs are the ledger's, at the default prices; `auto` against always-large.

Answers are kept in `--out` as they come (a rerun continues where one stopped). The last line is one JSON object:
`accuracy` (tier → category → ours and anchor), `malformed_calls`, `min_margin_vs_anchor` (points),
`small_gain_simple_multiple` (points), `auto_accuracy_ratio`, `auto_cost_ratio`, `auto_tiers` (the share of the
tool requests `auto` served on each tier).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from bench import bfcl
from bench.common import THREADS, say

TIER_MODELS = {"small": "qwen2.5-coder-0.5b-instruct", "large": "qwen2.5-coder-1.5b-instruct"}
MAX_TOKENS = 256
FENCED = re.compile(r"```(?:json)?\s*(.*?)```", re.S)
TAGGED = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _load(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["id"]: r for r in rows}


def _append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


# --- ours: through the gateway -------------------------------------------------------------------------


async def run_gateway(url: str, key: str, tier: str, qs: list[bfcl.Question], out: Path, concurrency: int) -> None:
    done = _load(out)
    todo = [q for q in qs if q.id not in done]
    say(f"{tier}: {len(done)} answered before, {len(todo)} to ask")
    gate, started, count = asyncio.Semaphore(concurrency), time.monotonic(), 0
    async with httpx.AsyncClient(timeout=600) as client:

        async def ask(q: bfcl.Question) -> None:
            nonlocal count
            body = {"model": tier, "messages": q.messages, "tools": bfcl.openai_tools(q.functions),
                    "tool_choice": "auto", "temperature": 0, "max_tokens": MAX_TOKENS}  # fmt: skip
            headers = {"Authorization": f"Bearer {key}", "x-switchboard-cache-control": "no-store"}
            async with gate:
                r = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            row: dict[str, Any] = {"id": q.id, "status": r.status_code, "tier": r.headers.get("x-switchboard-tier"),
                                   "request_id": r.headers.get("x-request-id")}  # fmt: skip
            if r.status_code == 200:
                message = r.json()["choices"][0]["message"]
                row["content"] = message.get("content")
                row["calls"] = [
                    [c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls") or []
                ]
            else:
                row["error"] = r.text[:500]
            _append(out, row)
            count += 1
            if count % 10 == 0 or count == len(todo):
                rate = count / (time.monotonic() - started)
                left = (len(todo) - count) / rate / 60
                say(f"  {tier}: {count}/{len(todo)} ({rate * 60:.1f}/min, {left:.0f} min left)")

        await asyncio.gather(*(ask(q) for q in todo))


def ledger_costs(db_url: str, out: Path, tier: str) -> None:
    """Each answered request's ledger cost, into `ledger-<tier>.json` (request id → cost as a string): the run's
    database goes with the gateway, and a resumed run's requests are in another one."""
    from sqlalchemy import select

    from core.db.database import Database
    from core.db.models import Usage

    path = out / f"ledger-{tier}.json"
    kept = json.loads(path.read_text()) if path.exists() else {}
    ids = [r["request_id"] for r in _load(out / f"ours-{tier}.jsonl").values() if r.get("request_id")]
    with Database(db_url).session() as s:
        kept |= {u.request_id: str(u.cost) for u in s.scalars(select(Usage).where(Usage.request_id.in_(ids)))}
    path.write_text(json.dumps(kept))


def costs(out: Path, tier: str) -> Decimal | None:
    """The ledger's total for the tier's answers, None unless every answer's cost is known."""
    path, rows = out / f"ledger-{tier}.json", _load(out / f"ours-{tier}.jsonl")
    kept = json.loads(path.read_text()) if path.exists() else {}
    ids = [r["request_id"] for r in rows.values() if r.get("request_id")]
    return sum((Decimal(kept[i]) for i in ids), Decimal(0)) if ids and all(i in kept for i in ids) else None


# --- the anchor: transformers, unconstrained -----------------------------------------------------------


def lenient_calls(text: str) -> list[tuple[str, Any]]:
    """Calls as a lenient parser reads unconstrained output: `<tool_call>` blocks, else fenced JSON blocks;
    an object with a `name` is a call (whatever the name), its `arguments` (or `parameters`) its arguments."""
    blocks = TAGGED.findall(text) or FENCED.findall(text)
    calls = []
    for block in blocks:
        try:
            value = json.loads(block.strip())
        except ValueError:
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                calls.append((item["name"], item.get("arguments", item.get("parameters", {}))))
    return calls


def anchor_dtype(choice: str) -> str:
    """bf16 (the checkpoints' own dtype) where the CPU multiplies it natively (AMX or AVX-512 BF16: oneDNN runs
    prefill there several times faster than fp32), else fp32."""
    if choice != "auto":
        return choice
    from engines.kernels.cpu_info import cpu_flags

    return "bfloat16" if {"amx_bf16", "avx512_bf16"} & cpu_flags() else "float32"


def run_anchor(tier: str, qs: list[bfcl.Question], out: Path, home: Path, dtype: str, batch: int) -> None:
    """Greedy, unconstrained, `batch` questions of similar length at a time (left-padded: on a CPU decode reads
    the weights once per step for the whole batch)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = _load(out)
    todo = [q for q in qs if q.id not in done]
    say(f"anchor {tier}: {len(done)} answered before, {len(todo)} to generate ({dtype}, batches of {batch})")
    if not todo:
        return
    model_dir = home / "models" / TIER_MODELS[tier]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    texts = {q.id: tokenizer.apply_chat_template(q.messages, tools=bfcl.openai_tools(q.functions),
                                                 add_generation_prompt=True, tokenize=False) for q in todo}  # fmt: skip
    todo.sort(key=lambda q: len(texts[q.id]))
    started, n = time.monotonic(), 0
    for i in range(0, len(todo), batch):
        group = todo[i : i + batch]
        ids = tokenizer([texts[q.id] for q in group], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            generated = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        for q, row in zip(group, generated[:, ids["input_ids"].shape[1] :], strict=True):
            text = tokenizer.decode(row, skip_special_tokens=True)
            _append(out, {"id": q.id, "text": text, "calls": [[n_, a] for n_, a in lenient_calls(text)]})
        n += len(group)
        rate = n / (time.monotonic() - started)
        say(f"  anchor {tier}: {n}/{len(todo)} ({rate * 60:.1f}/min, {(len(todo) - n) / rate / 60:.0f} min left)")


# --- scoring -------------------------------------------------------------------------------------------


def decoded(calls: list) -> list[tuple[str, dict]] | None:
    """[(BFCL's name, arguments)] from recorded calls (ours: arguments as JSON text), or None if any is unusable."""
    out = []
    for name, args in calls:
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict) or not isinstance(name, str):
            return None
        out.append((name, args))
    return out


def malformed(q: bfcl.Question, calls: list) -> int:
    """Calls that are not JSON, name no offered function, or break its schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in bfcl.openai_tools(q.functions)}
    bad = 0
    for name, args in calls:
        try:
            jsonschema.validate(json.loads(args) if isinstance(args, str) else args, schemas[name])
        except (ValueError, KeyError, jsonschema.ValidationError):
            bad += 1
    return bad


def score(qs: list[bfcl.Question], rows: dict[str, dict]) -> dict[str, float]:
    by_category: dict[str, list[bool]] = {}
    for q in qs:
        row = rows.get(q.id)
        calls = decoded(row.get("calls") or []) if row else None
        by_category.setdefault(q.category, []).append(calls is not None and bfcl.correct(q, calls))
    return {c: round(sum(v) / len(v), 4) for c, v in by_category.items()}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tools", description=__doc__.splitlines()[0])
    ap.add_argument("--per-category", type=int, default=40, help="questions per category (0: all)")
    ap.add_argument("--tiers", nargs="+", default=["small", "large", "auto"], choices=["small", "large", "auto"])
    ap.add_argument("--skip-anchor", action="store_true")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--anchor-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: bf16 where the CPU has AMX or AVX-512 BF16, else fp32")  # fmt: skip
    ap.add_argument("--anchor-batch", type=int, default=8, help="questions per transformers generate() call")
    ap.add_argument("--out", type=Path, default=Path("bench/results/tools"))
    ap.add_argument("--home", type=Path, default=Path("~/.cache/switchboard").expanduser())
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    qs = [q for c in bfcl.CATEGORIES for q in bfcl.questions(c, args.per_category or None)]
    say(f"{len(qs)} BFCL questions ({', '.join(bfcl.CATEGORIES)}), {THREADS} threads")
    from bench.gateway_run import gateway

    with gateway(args.home, args.out, THREADS) as (url, key, db_url):  # ours first: minutes, the anchor hours
        for tier in args.tiers:
            asyncio.run(run_gateway(url, key, tier, qs, args.out / f"ours-{tier}.jsonl", args.concurrency))
            ledger_costs(db_url, args.out, tier)
    if not args.skip_anchor:
        dtype = anchor_dtype(args.anchor_dtype)
        for tier in ("small", "large"):
            run_anchor(tier, qs, args.out / f"anchor-{tier}.jsonl", args.home, dtype, args.anchor_batch)
    return report(qs, args)


def report(qs: list[bfcl.Question], args: argparse.Namespace) -> int:
    accuracy: dict[str, dict[str, dict[str, float | None]]] = {}
    bad = 0
    for tier in args.tiers:
        ours = _load(args.out / f"ours-{tier}.jsonl")
        anchor_file = args.out / f"anchor-{'large' if tier == 'auto' else tier}.jsonl"
        anchor = _load(anchor_file)
        mine = score(qs, ours)
        theirs = score(qs, anchor) if all(q.id in anchor for q in qs) else {}  # a partial anchor is no anchor
        accuracy[tier] = {c: {"ours": mine.get(c), "anchor": theirs.get(c)} for c in bfcl.CATEGORIES}
        bad += sum(malformed(q, ours[q.id].get("calls") or []) for q in qs if q.id in ours)
        print(f"{tier:>6}: " + ", ".join(f"{c} {mine.get(c)} (anchor {theirs.get(c)})" for c in bfcl.CATEGORIES))
    margins = [(v["ours"] - v["anchor"]) * 100 for t in ("small", "large") if t in accuracy
               for v in accuracy[t].values() if v["ours"] is not None and v["anchor"] is not None]  # fmt: skip
    small = accuracy.get("small", {})
    gain = None
    if small and all(small[c]["anchor"] is not None for c in ("simple_python", "multiple")):
        gain = sum((small[c]["ours"] - small[c]["anchor"]) * 50 for c in ("simple_python", "multiple"))
    mean = {t: sum(v["ours"] for v in a.values()) / len(a) for t, a in accuracy.items()}
    spent = {t: costs(args.out, t) for t in ("auto", "large")}
    served = [r.get("tier") for r in _load(args.out / "ours-auto.jsonl").values()] if "auto" in args.tiers else []
    summary = {
        "questions": len(qs), "per_category": args.per_category, "threads": THREADS, "accuracy": accuracy,
        "malformed_calls": bad, "min_margin_vs_anchor": round(min(margins), 1) if margins else None,
        "small_gain_simple_multiple": round(gain, 1) if gain is not None else None,
        "auto_accuracy_ratio": round(mean["auto"] / mean["large"], 3) if {"auto", "large"} <= set(mean) else None,
        "auto_cost_ratio": round(float(spent["auto"] / spent["large"]), 3) if None not in spent.values() else None,
        # which tier `auto` served the tool requests on (the router has no tool labels: large, until verdicts exist)
        "auto_tiers": {t: round(served.count(t) / len(served), 3) for t in sorted(set(map(str, served)))} if served
        else None,
    }  # fmt: skip
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
