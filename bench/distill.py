"""A tenant's small tier distilled from its own large-tier traffic: the default policy's accuracy and cost on the
tenant's future requests before and after `switchboard distill`.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.distill [--history 300] [--requests 200] [--seed 0]
        [--epochs 2] [--max-tokens N] [--concurrency 32] [--router DIR] [--out DIR]

1. **The future**: `bench.savings`' trace (`bench/savings_trace.py`, seeded, `--requests`), every request sent
   with one tenant's key. **The history**: `--history` other items of the same shipped data sets, in the trace's
   mix by source (`SHARES`), none that the trace asks (`history_requests`): disjoint by prompt.
2. The history is replayed through a live gateway (`bench/savings_gateway.py`) as tenant `history`, on the
   built-in default policy with `router.store_prompts` on (the shadow and explore runs it starts settle before
   the next step).
3. The future is replayed on always-large (tenant `large`) and on the default policy as a fresh tenant `base`
   (the bare small tier): the *before*.
4. `switchboard distill --tenant history` (a subprocess on the same database: the large tier's answers to the
   stored prompts, training, the held-out gate, deploying: the adapter becomes the small tier's default and
   the tenant's routing learning restarts, so `history` routes the future from the same fresh learning state as
   `base` did). An adapter the gate did not deploy is still registered (`switchboard adapter add`) for step 6,
   and the after run serves the bare tier, as the product would.
5. The future is replayed on `history` again: the *after*.
6. The future's distinct prompts are asked of the small tier alone, `small` as `base` and `small:distilled`
   as `history` (no routing, no cache): the small tier's accuracy by source, base against distilled.

Every answer is graded as `bench.savings` grades (`bench/savings_grade.py`: GSM8K by final number, HumanEval
in the jail, facts by containment, open chat judged by the large tier against always-large's answer). Money
per request from the ledger's rows (`bench/savings_learned.per_request`; the gateway's own shadow and explore
runs are reported apart). Writes to `--out` the trace and history, every response (`<run>.jsonl`), the grades,
the distill report and the gateway's log; prints a table; the last line is JSON: `small_accuracy` (by source:
`all` on the distinct future prompts run small, `served` on the future requests the small tier served in the
default runs; each `base` and `distilled`), `small_gsm8k_gain_points`, `default_accuracy_ratio`,
`default_cost_ratio`, `default_accuracy_ratio_after`, `default_cost_ratio_after`, `large_share` and
`large_share_before`, `tiers_before`/`tiers_after`, `train_seconds`, `train_examples`, `seconds_per_1000_examples`,
`heldout`, `base_agreement`, `adapter_agreement`, `deployed`, `adapter_bytes`, `distill_seconds`, `failed`.
Targets (issue 54): `small_gsm8k_gain_points` ≥ 8 with no source below −2 points, and after distilling
`default_accuracy_ratio_after` ≥ 0.95 at `default_cost_ratio_after` ≤ 0.40.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench import savings_gateway as gateway
from bench import savings_grade as grade
from bench import savings_learned as learned
from bench.savings_gateway import Served, say
from bench.savings_report import ratio
from bench.savings_trace import MAX_TOKENS, SHARES, Request, build_trace, load_pools, quotas
from grading.datasets import Item
from grading.sandbox import add_unsafe_flag, require_jail

ADAPTER = "distilled"
TENANTS = ("history", "base", "large", "judge")
FUTURE_RUNS = ("large", "before", "after")  # the future trace: always-large, default policy before and after
SMALL_RUNS = ("small_base", "small_distilled")  # the future's distinct prompts on the small tier alone


def history_requests(pools: dict[str, Sequence[Item]], future: Sequence[Request], n: int, seed: int) -> list[Request]:
    """n requests of items the future never asks, in its mix by source (fewer where a source runs out), in a
    seeded order; every one an original, all due at once."""
    asked = {r.item_id for r in future}
    rng = random.Random(f"history-{seed}")
    picked: list[Item] = []
    for source, k in quotas(n, SHARES).items():
        unused = [item for item in pools[source] if item.id not in asked]
        picked += rng.sample(unused, min(k, len(unused)))
    rng.shuffle(picked)
    return [Request(i, "history", 0.0, 0, it.source, it.id, "original", None, it.messages, dict(it.grading),
                    MAX_TOKENS[it.source]) for i, it in enumerate(picked)]  # fmt: skip


def originals(trace: Sequence[Request]) -> list[Request]:
    """The trace's distinct prompts (its originals), re-indexed from 0, all due at once."""
    firsts = [r for r in trace if r.kind == "original"]
    return [replace(r, index=i, at=0.0, of=None) for i, r in enumerate(firsts)]


def create_tenants(db_url: str) -> tuple[dict[str, gateway.Tenant], str]:
    """The bench's tenants (`TENANTS`) and an admin key: `history` and `base` on the built-in default policy
    with stored prompts, `large` on the always-large policy, `judge` without checks."""
    from core.db.database import Database
    from gateway.accounting.tenants import create_tenant, tenant_by_name
    from policies.policy import Policy
    from policies.store import PolicyStore

    stored = gateway.default_policy()
    stored = stored.model_copy(update={"router": stored.router.model_copy(update={"store_prompts": True})})
    plan = {"history": stored, "base": stored, "large": gateway.large_policy(),
            "judge": Policy(verifiers=gateway.large_policy().verifiers, **gateway.far_limits())}  # fmt: skip
    db = Database(db_url)
    suffix = os.urandom(3).hex()
    tenants: dict[str, gateway.Tenant] = {}
    try:
        for role, policy in plan.items():
            name = f"distill-{role}-{suffix}"
            key = create_tenant(db, name, actor="bench").key
            found = tenant_by_name(db, name)
            assert found is not None
            PolicyStore(db).save(found.id, policy, "bench", note="bench/distill.py")
            tenants[role] = gateway.Tenant(name, key, role, role, policy)
        admin = create_tenant(db, f"distill-admin-{suffix}", operator=True, role="admin", actor="bench").key
    finally:
        db.dispose()
    return tenants, admin


def _keys(tenant: gateway.Tenant) -> dict[str, str]:
    """Every trace tenant's requests on this one tenant's key (the trace's roles collapse into it)."""
    return {role: tenant.key for role in (*gateway.ROLES, "history")}


def _replay(gw: Served, part: Sequence[Request], tenant: gateway.Tenant, model: str, run: str,
            args: argparse.Namespace, *, no_store: bool, time_scale: float) -> list[dict[str, Any]]:  # fmt: skip
    rows = gateway.replay(gw.url, part, _keys(tenant), model=model, no_store=no_store, concurrency=args.concurrency,
                          time_scale=time_scale, timeout=args.timeout, record=args.out / f"{run}.jsonl",
                          desc=run)  # fmt: skip
    return asyncio.run(rows)


def _settle(gw: Served, admin: str, tenant: gateway.Tenant) -> None:
    say(f"waiting for {tenant.name}'s shadow and explore runs to settle")
    gateway.settle_router(gw.url, admin, {tenant.role: tenant.name}, learned._probe, learned.SETTLE_S)


def _cli_env(home: Path, gw: Served) -> dict[str, str]:
    from bench.serve import serve_env

    none = "/nonexistent/switchboard.toml"  # the bench's settings are the environment's alone
    return serve_env(home, gw.db_url, 0, SWITCHBOARD_PROFILE="default", SWITCHBOARD_CONFIG=none)


def run_distill(home: Path, gw: Served, tenant: gateway.Tenant, args: argparse.Namespace) -> dict[str, Any]:
    """`switchboard distill` as an operator runs it; its report (the last line), with its wall time. An adapter the
    gate refused is registered anyway (not as the default) so the small tier can be asked with it."""
    cmd = [sys.executable, "-m", "gateway.cli", "distill", "--tenant", tenant.name, "--name", ADAPTER,
           "--epochs", str(args.epochs), "--max-tokens", str(args.distill_max_tokens)]  # fmt: skip
    say(f"distilling: {' '.join(cmd[2:])} (log {args.out / 'distill.log'})")
    started = time.monotonic()
    with (args.out / "distill.log").open("w") as log:
        done = subprocess.run(cmd, env=_cli_env(home, gw), stdout=subprocess.PIPE, stderr=log, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"switchboard distill failed ({done.returncode}); see {args.out / 'distill.log'}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["distill_seconds"] = round(time.monotonic() - started, 1)
    if not report["deployed"]:
        from core.db.database import Database
        from gateway.accounting.tenants import tenant_by_name

        db = Database(gw.db_url)
        try:
            found = tenant_by_name(db, tenant.name)
        finally:
            db.dispose()
        assert found is not None
        folder = home / "distill" / f"t{found.id}" / ADAPTER / "train" / "adapter"  # this tenant's, not any t*
        add = [sys.executable, "-m", "gateway.cli", "adapter", "add", tenant.name, "small", ADAPTER, str(folder)]
        subprocess.run(add, env=_cli_env(home, gw), check=True, stdout=subprocess.DEVNULL)
    (args.out / "distill.json").write_text(json.dumps(report, indent=2))
    return report


def measure(home: Path, gw: Served, trace: list[Request], history: list[Request], firsts: list[Request],
            args: argparse.Namespace) -> tuple[dict[str, list[dict]], dict[str, Any]]:  # fmt: skip
    """Steps 2-6: run → records (the future's runs in trace order, the small runs in `firsts`' order) and the
    distill report."""
    tenants, admin = create_tenants(gw.db_url)
    results: dict[str, list[dict]] = {}
    results["history"] = _replay(gw, history, tenants["history"], "auto", "history", args, no_store=False, time_scale=0)
    _settle(gw, admin, tenants["history"])
    results["large"] = _replay(gw, trace, tenants["large"], "large", "large", args, no_store=True,
                               time_scale=args.time_scale)  # fmt: skip
    results["before"] = _replay(gw, trace, tenants["base"], "auto", "before", args, no_store=False,
                                time_scale=args.time_scale)  # fmt: skip
    _settle(gw, admin, tenants["base"])
    report = run_distill(home, gw, tenants["history"], args)
    results["after"] = _replay(gw, trace, tenants["history"], "auto", "after", args, no_store=False,
                               time_scale=args.time_scale)  # fmt: skip
    _settle(gw, admin, tenants["history"])
    for run, tenant, model in (("small_base", "base", "small"), ("small_distilled", "history", f"small:{ADAPTER}")):
        results[run] = _replay(gw, firsts, tenants[tenant], model, run, args, no_store=True, time_scale=0)
    results["_tenants"] = [{"role": t.role, "name": t.name, "key": t.key} for t in tenants.values()]  # type: ignore[list-item]
    return results, report


def grade_all(gw: Served, trace: list[Request], firsts: list[Request], results: dict[str, list[dict]],
              judge_key: str, args: argparse.Namespace) -> tuple[dict[str, list], dict[str, list]]:  # fmt: skip
    """Grades of the future's runs (trace order) and of the small runs (`firsts`' order); open chat judged
    against always-large's answer to the same prompt."""

    def judge(conversations: list[list[dict[str, str]]]) -> list[str | None]:
        from router_model.label import JUDGE_MAX_TOKENS

        asks = gateway.ask_large(gw.url, judge_key, conversations, JUDGE_MAX_TOKENS, args.concurrency, args.timeout)
        return asyncio.run(asks)

    future = grade.grade_references(trace, {r: results[r] for r in FUTURE_RUNS}, args.grade_workers)
    for run in FUTURE_RUNS[1:]:
        grade.judge_chats(trace, results["large"], results[run], future, judge, run=run)
    large_firsts = [results["large"][r.index] for r in trace if r.kind == "original"]
    small = grade.grade_references(firsts, {"large": large_firsts, **{r: results[r] for r in SMALL_RUNS}},
                                   args.grade_workers)  # fmt: skip
    for run in SMALL_RUNS:
        grade.judge_chats(firsts, large_firsts, results[run], small, judge, run=run)
    return future, small


def by_source(part: Sequence[Request], grades: list, keep: Sequence[bool] | None = None) -> dict[str, float | None]:
    """Accuracy per source (and `all`) over the graded requests of `part` where `keep` holds."""
    out: dict[str, float | None] = {}
    for source in (*SHARES, "all"):
        got = [grades[r.index] for r in part if (source == "all" or r.source == source)
               and (keep is None or keep[r.index]) and grades[r.index] is not None]  # fmt: skip
        out[source] = round(sum(got) / len(got), 4) if got else None
    return out


def _points(base: float | None, distilled: float | None) -> float | None:
    return None if base is None or distilled is None else round(100 * (distilled - base), 1)


def money(results: dict[str, list[dict]], db_url: str) -> dict[str, list[dict[str, Decimal]]]:
    """The future runs' ledger money per request (the tenants' rows matched by request id)."""
    rows = grade.ledger_rows(db_url, [t["name"] for t in results["_tenants"]])  # type: ignore[index]
    everything = [row for name_rows in rows.values() for row in name_rows]
    return {run: learned.per_request(results[run], everything)[0] for run in FUTURE_RUNS}


def report(trace: list[Request], firsts: list[Request], results: dict[str, list[dict]], future: dict[str, list],
           small: dict[str, list], amounts: dict[str, list[dict[str, Decimal]]], distilled: dict[str, Any]
           ) -> dict[str, Any]:  # fmt: skip
    """The table and the last line's figures."""
    roles = {r.tenant for r in trace}
    s = {run: learned.part_summary(trace, results[run], future[run], amounts[run], roles) for run in FUTURE_RUNS}
    all_small = {name: by_source(firsts, small[f"small_{name}"]) for name in ("base", "distilled")}
    served = {name: by_source(trace, future[run], [x.get("tier") == "small" for x in results[run]])
              for name, run in (("base", "before"), ("distilled", "after"))}  # fmt: skip
    gains = {src: _points(all_small["base"][src], all_small["distilled"][src]) for src in all_small["base"]}
    print(f"\nThe future trace ({len(trace)} requests; {len(firsts)} distinct prompts)")
    print(f"{'run':<22}{'accuracy':>10}{'cost $':>12}  tiers")
    for run in FUTURE_RUNS:
        tiers = ", ".join(f"{t} {v:.0%}" for t, v in s[run]["tiers"].items())
        print(f"{run:<22}{s[run]['accuracy'] or 0:>10.3f}{float(s[run]['cost']):>12.6f}  {tiers}")
    print(f"\nThe small tier alone on the distinct prompts, by source (points gained: {json.dumps(gains)})")
    for name, acc in all_small.items():
        print(f"{name:<22}" + "  ".join(f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in acc.items()))
    large = s["large"]
    training, data = distilled.get("training") or {}, distilled.get("data") or {}
    return {
        "requests": len(trace), "distinct": len(firsts),
        "small_accuracy": {"all": all_small, "served": served}, "small_gain_points": gains,
        "small_gsm8k_gain_points": gains["gsm8k"],
        "accuracy_large": large["accuracy"], "cost_large": float(large["cost"]),
        "default_accuracy_ratio": ratio(s["before"]["accuracy"], large["accuracy"]),
        "default_cost_ratio": ratio(s["before"]["cost"], large["cost"]),
        "default_accuracy_ratio_after": ratio(s["after"]["accuracy"], large["accuracy"]),
        "default_cost_ratio_after": ratio(s["after"]["cost"], large["cost"]),
        "large_share": round(s["after"]["tiers"].get("large", 0.0), 4),
        "large_share_before": round(s["before"]["tiers"].get("large", 0.0), 4),
        "tiers_before": {t: round(v, 4) for t, v in s["before"]["tiers"].items()},
        "tiers_after": {t: round(v, 4) for t, v in s["after"]["tiers"].items()},
        "train_seconds": training.get("train_seconds"), "train_examples": data.get("examples"),
        "seconds_per_1000_examples": training.get("seconds_per_1000_examples"),
        "heldout": data.get("heldout"), "rejected": data.get("rejected"),
        "base_agreement": distilled.get("base_agreement"), "adapter_agreement": distilled.get("adapter_agreement"),
        "deployed": distilled.get("deployed"), "adapter_bytes": distilled.get("adapter_bytes"),
        "distill_seconds": distilled.get("distill_seconds"),
        "failed": {run: sum(not x.get("ok") for x in results[run]) for run in (*FUTURE_RUNS, *SMALL_RUNS, "history")},
    }  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--history", type=int, default=300, help="the tenant's past requests (distinct prompts)")
    p.add_argument("--requests", type=int, default=200, help="requests in the future trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2, help="`switchboard distill --epochs`")
    p.add_argument("--distill-max-tokens", type=int, default=384, help="the teacher's longest answer")
    p.add_argument("--max-tokens", type=int, help="cap every source's max_tokens (a smoke run)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--time-scale", type=float, default=0.0, help="the future's arrival times × this (0: all at once)")
    p.add_argument("--router", type=Path, help="a saved router (default: HOME/router, else trained first)")
    p.add_argument("--home", type=Path, default=Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")))
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "sb-bench-distill")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--grade-workers", type=int, default=2)
    add_unsafe_flag(p)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    require_jail(args.unsafe_local_grading)
    home = args.home.expanduser()
    args.out.mkdir(parents=True, exist_ok=True)
    pools = load_pools(home)
    trace = build_trace(pools, args.requests, args.seed, max_tokens=args.max_tokens)
    history = history_requests(pools, trace, args.history, args.seed)
    if args.max_tokens:
        history = [replace(r, max_tokens=min(r.max_tokens, args.max_tokens)) for r in history]
    firsts = originals(trace)
    for name, part in (("trace", trace), ("history", history)):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in part))
    say(f"future {len(trace)} requests ({len(firsts)} distinct), history {len(history)} prompts")
    router_dir = gateway.prepare_router(args.router, "default", home, args.out)
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    gw = gateway.start_gateway(home, "default", router_dir, False, args.out / "gateway.log", threads)
    try:
        results, distilled = measure(home, gw, trace, history, firsts, args)
        judge_key = next(t["key"] for t in results["_tenants"] if t["role"] == "judge")  # type: ignore[index]
        say("grading")
        future, small = grade_all(gw, trace, firsts, results, judge_key, args)
        gateway.settle_ledger(gw.db_url, [t["name"] for t in results["_tenants"]],  # type: ignore[index]
                              sum(x.get("ok", False) for run in (*FUTURE_RUNS, *SMALL_RUNS, "history")
                                  for x in results[run]))  # fmt: skip
        amounts = money(results, gw.db_url)
    finally:
        gw.stop()
    (args.out / "grades.json").write_text(json.dumps({"future": future, "small": small}))
    print(json.dumps(report(trace, firsts, results, future, small, amounts, distilled)))


if __name__ == "__main__":
    main()
