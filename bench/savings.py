"""The gateway's promise on one mixed trace: what `model: "auto"` with each tenant's policy costs and gets
right against sending everything to the large tier, and what the finance API says was saved, by lever.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.savings [--requests 800] [--seed 0] [--profile default|tiny]
        [--concurrency 32] [--time-scale 1] [--max-tokens N] [--router DIR] [--embedded] [--out DIR]
        [--shadow-share S] [--runs large auto default learned]

The trace (`bench/savings_trace.py`, seeded): GSM8K, HumanEval, short facts, MT-bench first turns and chat
openers, about 30% of them repeats or paraphrases of earlier requests, three tenants, arrivals in bursts
of 5-40. It is replayed through a live `switchboard serve` (`bench/savings_gateway.py`: a fresh PostgreSQL
database and a Redis namespace, or `--embedded` SQLite and in-process counters) once per run, at most
`--concurrency` requests in flight, each at its arrival time (`--time-scale 0`: all at once):

  large    every request on `large`, `"cache": "no-store"`, tenants whose policy turns the cache off;
  auto     `model: "auto"` with each tenant's policy: `saver` (10% of its prompts large, semantic cache, a
           max_tokens cap at 3/4 of the largest request's), `balanced` (30% large), `quality` (60% large,
           the `prompt_examples` check with a cascade to large, the degeneration verifier). Each threshold
           sends its share of the trace's distinct prompts large, as `switchboard router calibrate --tenant`
           would;
  default  `model: "auto"` with every tenant on the built-in default policy (a 0.95 quality floor, the
           semantic cache beside the exact one, the cheaper tiers' answers shadow-run on large: half until
           a tenant has 50 verdicts, 5% after; code checks with a cascade); once its shadow runs are done,
           each tenant's estimated quality ratio is read from `GET /v1/admin/router`;
  learned  three fresh tenants on the same built-in default policy (it explores and learns per tenant by
           itself), the trace in two halves (`bench/savings_learned.py`): each tenant's first half of its own
           requests (trace order) is replayed, the gateway's shadow and explore runs left to settle
           (`learning.verdicts` and `quality.estimate` unchanged for 15 s, at most 900 s), then the rest is
           replayed and scored alone, against always-large on the same requests, its cost from the
           ledger's rows matched by request id (background `-shadow`/`-explore` rows reported apart).

Every answer is graded (`bench/savings_grade.py`; open chat judged by the large tier against the
always-large answer). Cost and the saving by lever come from `GET /v1/finance/savings` for each run's
tenants and days, checked against the ledger's rows and their tokens × prices: a relative difference
above 1e-6 fails the run (exit status 1). The routing time is the `switchboard_route_seconds` histogram
over the auto run (the gateway records no per-request routing time), its median interpolated in its bucket.

The router: `--router DIR`, else for the default profile HOME/router if it loads, else one trained first,
on the shipped labels (minutes); `--profile tiny` (SmolLM2-135M as both `small` and `large`) trains one on
synthetic labels (seconds).
Writes to `--out`: the trace, every response (`<run>.jsonl`, as they come; `learned.jsonl` both halves),
the grades (`grades.json`: run → true / false / null per request, in trace order), the gateway's log and
`savings.png` (accuracy against cost: the router's held-out threshold sweep, each tenant's threshold on it,
the run's measured points). Prints a table per run and tenant, and one of the score part ("large (2nd
half)", "default (2nd half)", "learned (2nd half)"); the last line is JSON:
`accuracy_ratio` and `cost_ratio` (auto / always-large), `default_accuracy_ratio`, `default_cost_ratio` and
`tiny_share` (the default run), `estimated_quality_ratio` (per tenant: the gateway's estimate from its
shadow runs beside the graded ratio, default run / always-large), `apgr` and `apgr_ci_low` (the router's
metadata; null when absent), `route_p50_ms`, `saved_<lever>` (USD, auto run), hit rate, failures; for the
learned run, on the score part: `learned_accuracy_ratio`, `learned_cost_ratio`, `learned_large_share`,
`learned_tiers`, the gateway's `learned_explore_runs`, `learned_explore_cost_usd`, `learned_shadow_cost_usd`,
`learned_active` and `learned_threshold` (per tenant), `learned_background_ledger`; and
`default_accuracy_ratio_second_half`, `default_cost_ratio_second_half` (the default run on the same requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench import savings_gateway as gateway
from bench import savings_grade as grade
from bench import savings_learned as learned
from bench.savings_gateway import LARGE_SHARES, ROLES, Served, say
from bench.savings_grade import LEVERS
from bench.savings_report import calibrate, heldout_sweep, plot, print_table, ratio, router_figures, summarize
from bench.savings_trace import Request, build_trace, load_pools, summary
from grading.sandbox import add_unsafe_flag, require_jail

RUNS = ("large", "auto", "default", "learned")


@dataclass
class Measured:
    results: dict[str, list[dict]]  # run → one record per request, in trace order
    grades: dict[str, list]  # run → True / False / None (not gradable) per request
    finance: dict[tuple[str, str], dict]  # (run, role) → the finance API's row
    problems: list[str]  # the cross-check's disagreements
    route_p50_ms: float | None
    notes: dict[str, Any]
    amounts: dict[str, list[dict[str, Decimal]]] = field(default_factory=dict)  # run → ledger money per request
    unclaimed: dict[str, dict[str, Any]] = field(default_factory=dict)  # run → ledger rows no response claims


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.savings", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=800, help="requests in the trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", choices=("default", "tiny"), default="default")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    p.add_argument("--time-scale", type=float, default=1.0, help="arrival times × this (0: all due at once)")
    p.add_argument("--max-tokens", type=int, help="cap every source's max_tokens (e.g. 16 for a smoke run)")
    p.add_argument("--repeat-share", type=float, default=0.3, help="requests that repeat or paraphrase (≤ 0.4)")
    p.add_argument("--router", type=Path, help="a saved router (default: see above)")
    p.add_argument("--embedded", action="store_true", help="SQLite and in-process counters, no PostgreSQL/Redis")
    p.add_argument("--home", type=Path, default=Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")))
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "sb-bench-savings")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one request may take")
    p.add_argument("--grade-workers", type=int, default=2, help="HumanEval sandbox runs at once")
    add_unsafe_flag(p)
    p.add_argument("--shadow-share", type=float, help="the default run's shadow share (default: the policy's 0.05)")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                   help="which runs (default: all four); large, the baseline, always runs")  # fmt: skip
    args = p.parse_args()
    args.runs = [run for run in RUNS if run == "large" or run in args.runs]  # in replay order, baseline first
    if args.runs == ["large"]:
        p.error("--runs needs auto, default or learned beside large: there is nothing to compare")
    return args


def measure(args: argparse.Namespace, gw: Served, trace: list[Request], thresholds: dict[str, float]) -> Measured:
    """The runs, the grading, the finance API's answer and the cross-check."""
    cap = max(1, round(0.75 * max(r.max_tokens for r in trace)))
    tenants, ops, admin = gateway.create_tenants(gw.db_url, gateway.auto_policies(thresholds, cap), args.shadow_share)
    keys = {run: {role: tenants[(run, role)].key for role in ROLES} for run in RUNS}
    if not gateway.offers_auto(gw.url, keys[args.runs[1]]["balanced"]):
        raise SystemExit(f'the gateway offers no `model: "auto"` (see {gw.log}); nothing to compare')
    first_day = datetime.now(UTC).date()
    results: dict[str, list[dict]] = {}
    common = {"concurrency": args.concurrency, "time_scale": args.time_scale, "timeout": args.timeout}
    route_p50, estimates, learning = None, {}, {}
    for run in args.runs:
        names = {role: tenants[(run, role)].name for role in ROLES}
        if run == learned.RUN:  # in two halves, with waits for the background runs between
            results[run], learning = learned.replay_learned(gw.url, trace, keys[run], admin, names,
                                                            args.out / f"{run}.jsonl", common)  # fmt: skip
            continue
        model = "large" if run == "large" else "auto"
        before = gateway.route_histogram(gw.url)
        replay = gateway.replay(gw.url, trace, keys[run], model=model, no_store=run == "large",
                                record=args.out / f"{run}.jsonl", desc=run, **common)  # fmt: skip
        results[run] = asyncio.run(replay)
        if run == "auto":  # the auto run's decisions
            route_p50 = gateway.histogram_p50_ms(before, gateway.route_histogram(gw.url))
        if run == "default":  # before the next run: its shadow runs are the default run's alone
            say("waiting for the default run's shadow runs")
            estimates = gateway.quality_estimates(gw.url, admin, names)
    for run in args.runs:
        if failed := [x for x in results[run] if not x.get("ok")]:
            say(f"{run}: {len(failed)} of {len(trace)} requests failed, e.g. {[x['error'] for x in failed[:3]]}")
    say("grading")
    grades = grade.grade_references(trace, results, args.grade_workers)
    judge_key = tenants[("judge", "judge")].key

    def judge(conversations: list[list[dict[str, str]]]) -> list[str | None]:
        from router_model.label import JUDGE_MAX_TOKENS

        asks = gateway.ask_large(gw.url, judge_key, conversations, JUDGE_MAX_TOKENS, args.concurrency, args.timeout)
        return asyncio.run(asks)

    judged: dict[str, int] = {}
    for run in args.runs[1:]:
        for k, n in grade.judge_chats(trace, results["large"], results[run], grades, judge, run=run).items():
            judged[k] = judged.get(k, 0) + n
    (args.out / "grades.json").write_text(json.dumps(grades))  # run → per request, trace order: for later analysis
    names = {t.name: t for t in tenants.values() if t.run in args.runs}
    answered = sum(x.get("ok", False) for run in args.runs for x in results[run])
    rows = gateway.settle_ledger(gw.db_url, list(names), answered)
    finance = grade.finance_savings(gw.url, ops, first_day, datetime.now(UTC).date())
    ledger = grade.ledger_rows(gw.db_url, list(names))
    policies = {n: t.policy for n, t in names.items()}
    problems = grade.crosscheck({n: finance[n] for n in names if n in finance}, ledger, policies)
    empty = {"requests": 0, **{k: Decimal(0) for k in grade.AMOUNTS}}
    by_role = {(t.run, t.role): finance.get(n, empty) for n, t in names.items()}
    usage = grade.usage_agreement([x for run in args.runs for x in results[run]], ledger)
    notes = {**judged, "ledger_rows": rows, "usage": usage, "thresholds": thresholds, "saver_max_tokens_cap": cap,
             "estimates": estimates, "learning": learning}  # fmt: skip
    amounts, unclaimed = {}, {}
    for run in args.runs:  # the money per request, from the ledger: the score part's cost (finance is per day)
        run_rows = [row for t in tenants.values() if t.run == run for row in ledger.get(t.name, [])]
        amounts[run], unclaimed[run] = learned.per_request(results[run], run_rows)
    return Measured(results, grades, by_role, problems, route_p50, notes, amounts, unclaimed)


def report(args: argparse.Namespace, trace: list[Request], m: Measured, router_dir: Path) -> dict[str, Any]:
    """The tables, the PNG, and the summary that becomes the last line."""
    summaries: dict[str, dict[str, Any]] = {}
    for run in (r for r in args.runs if r != learned.RUN):  # the learned run is scored on its second half alone
        for label, roles in ((f"{run}/", ROLES), *((f"{run}/{role}", (role,)) for role in ROLES)):
            finance = [m.finance[(run, r)] for r in roles]
            summaries[label] = summarize(trace, m.results[run], m.grades[run], finance, set(roles))
    title = f"Savings on one mixed trace: {len(trace)} requests, profile {args.profile}, seed {args.seed}"
    print_table(title, summaries)
    _, score = learned.split_by_tenant(trace)
    halves = learned.half_summaries(score, [r for r in args.runs if r != "auto"], m.results, m.grades, m.amounts)
    if len(halves) > 1 + len(ROLES):  # more than always-large's rows: default or learned ran
        print_table(f"The score part ({len(score)} requests, each tenant's second half; money from the ledger)",
                    halves)  # fmt: skip
    large = summaries["large/"]
    # a run left out (--runs) reports nulls: the same keys in the last line either way
    absent = {"accuracy": None, "cost": None, "tiers": {}, "hit_rate": 0.0, "saved": dict.fromkeys(LEVERS, Decimal(0)),
              "counterfactual": None, "failed": None, "cascaded": None}  # fmt: skip
    auto, default = summaries.get("auto/", absent), summaries.get("default/", absent)
    measured = {"always large (trace)": (1.0, large["accuracy"] or 0.0)}
    if "auto" in args.runs:
        measured["auto (trace)"] = (ratio(auto["cost"], large["cost"]) or 0.0, auto["accuracy"] or 0.0)
        for role in ROLES:
            s, base = summaries[f"auto/{role}"], summaries[f"large/{role}"]
            measured[f"auto, {role}"] = (ratio(s["cost"], base["cost"]) or 0.0, s["accuracy"] or 0.0)
    if "default" in args.runs:
        measured["default policy (trace)"] = (ratio(default["cost"], large["cost"]) or 0.0, default["accuracy"] or 0.0)
    if learned.RUN in args.runs:
        half = halves[f"{learned.RUN} {learned.HALF}/"]
        measured["learned (2nd half)"] = (learned.score_ratios(halves, learned.RUN)[1] or 0.0, half["accuracy"] or 0.0)
    sweep = heldout_sweep(router_dir, args.home.expanduser())
    if sweep is None:
        say("the router's label file is gone or it held nothing out: the plot has no held-out sweep")
    png = plot(sweep, m.notes["thresholds"], measured, args.out / "savings.png",
               f"Cost against accuracy, {len(trace)} requests ({args.profile})")  # fmt: skip
    print(f"\nplot: {png}\nrouting thresholds: {json.dumps(m.notes['thresholds'])}")
    print(f"judge: {m.notes.get('judged', 0)} judged, {m.notes.get('judge_failed', 0)} failed; "
          f"responses' usage against the ledger: {m.notes['usage']}")  # fmt: skip
    saved = sum(auto["saved"].values(), Decimal(0))
    return {
        "requests": len(trace), "profile": args.profile, "seed": args.seed, "shadow_share": args.shadow_share,
        "accuracy_large": large["accuracy"], "accuracy_auto": auto["accuracy"],
        "accuracy_ratio": ratio(auto["accuracy"], large["accuracy"]),
        "cost_large": float(large["cost"]), "cost_auto": None if auto["cost"] is None else float(auto["cost"]),
        "cost_ratio": ratio(auto["cost"], large["cost"]),
        **router_figures(router_dir), "route_p50_ms": m.route_p50_ms,
        "hit_rate": round(auto["hit_rate"], 4), "large_share": round(auto["tiers"].get("large", 0.0), 4),
        **{f"saved_{lv}": float(auto["saved"][lv]) for lv in LEVERS},
        "saved_share": ratio(saved, auto["counterfactual"]),
        "default_accuracy_ratio": ratio(default["accuracy"], large["accuracy"]),
        "default_cost_ratio": ratio(default["cost"], large["cost"]),
        "tiny_share": round(default["tiers"].get("tiny", 0.0), 4),
        "estimated_quality_ratio": (
            estimated_quality(summaries, m.notes["estimates"]) if "default" in args.runs else None
        ),
        "failed_large": large["failed"], "failed_auto": auto["failed"], "failed_default": default["failed"],
        "cascaded": auto["cascaded"], "cascaded_default": default["cascaded"],
        **learned.learned_keys(halves, args.runs, m.notes["learning"], m.unclaimed.get(learned.RUN)),
        "failed_learned": (sum(not x.get("ok") for x in m.results[learned.RUN]) if learned.RUN in args.runs
                           else None),
        "judged": m.notes.get("judged", 0), "runs": args.runs,
        "crosscheck": "ok" if not m.problems else "FAILED", "png": str(png),
    }  # fmt: skip


def estimated_quality(summaries: dict[str, dict[str, Any]], estimates: dict[str, Any]) -> dict[str, Any]:
    """Per tenant of the default run: the gateway's estimate from its shadow runs (ratio, interval, verdicts)
    beside the graded truth, its accuracy over always-large's on the same requests."""
    out = {}
    for role in ROLES:
        found = estimates.get(role) or {}
        graded = ratio(summaries[f"default/{role}"]["accuracy"], summaries[f"large/{role}"]["accuracy"])
        out[role] = {"estimate": found.get("ratio"), "low": found.get("low"), "high": found.get("high"),
                     "judged": found.get("judged", 0), "graded": graded}  # fmt: skip
    return out


def main() -> None:
    args = parse_args()
    require_jail(args.unsafe_local_grading)  # before an hour of replay: the grading runs HumanEval answers
    home = args.home.expanduser()
    args.out.mkdir(parents=True, exist_ok=True)
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    trace = build_trace(load_pools(home), args.requests, args.seed, repeat_share=args.repeat_share,
                        max_tokens=args.max_tokens)  # fmt: skip
    (args.out / "trace.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in trace))
    say(f"trace: {json.dumps(summary(trace))}")
    router_dir = gateway.prepare_router(args.router, args.profile, home, args.out)
    thresholds = calibrate(router_dir, trace, LARGE_SHARES, home)
    say(f"router {router_dir}; thresholds {thresholds}; starting the gateway (log {args.out / 'gateway.log'})")
    gw = gateway.start_gateway(home, args.profile, router_dir, args.embedded, args.out / "gateway.log", threads)
    try:
        measured = measure(args, gw, trace, thresholds)
    finally:
        gw.stop()
    result = report(args, trace, measured, router_dir)
    for problem in measured.problems:
        say(f"CROSS-CHECK FAILED: {problem}")
    print(json.dumps(result))
    if measured.problems:
        sys.exit(f"the finance API disagrees with prices × usage ({len(measured.problems)} problems, above)")


if __name__ == "__main__":
    main()
