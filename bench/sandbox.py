"""What the code jail costs a run, and that HumanEval's canonical solutions still pass in it.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.sandbox [--runs 50] [--no-humaneval]

Times `grading.sandbox.run_python` on a program that does nothing (`pass`) and on a small HumanEval-style one
(a function and its asserts), in the jail this machine builds and under the old fence (the audit hook,
limits and `unshare -rn`: what every run was before the jail), alternating the two so that both see the same
machine, `--runs` times each; medians and the added milliseconds per run. Then all 164 canonical HumanEval
solutions through the jail, graded as `switchboard router label` grades them. The last line is one JSON
object. Nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from bench.common import say
from grading.sandbox import jail_status, run_python, run_unjailed

SMALL = "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def _ms(run: object, program: str) -> float:
    started = time.perf_counter()
    result = run(program)  # type: ignore[operator]
    elapsed = (time.perf_counter() - started) * 1000
    if not result.passed:
        raise SystemExit(f"the timed program failed: {result.stderr[-500:]}")
    return elapsed


def timings(runs: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, program in (("pass", "pass\n"), ("small", SMALL)):
        jailed, fenced = [], []
        for _ in range(runs):  # alternated: both see the same load
            jailed.append(_ms(run_python, program))
            fenced.append(_ms(run_unjailed, program))
        out[f"{name}_jail_p50_ms"] = round(statistics.median(jailed), 1)
        out[f"{name}_fence_p50_ms"] = round(statistics.median(fenced), 1)
        out[f"{name}_added_p50_ms"] = round(statistics.median(jailed) - statistics.median(fenced), 1)
        say(f"{name}: jail {out[f'{name}_jail_p50_ms']} ms, old fence {out[f'{name}_fence_p50_ms']} ms (medians)")
    return out


def humaneval() -> dict[str, object]:
    from grading.datasets import load_humaneval_items
    from grading.graders import run_humaneval

    home = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()
    items = load_humaneval_items(home)
    started, failed = time.perf_counter(), []
    for i, item in enumerate(items, 1):
        if not run_humaneval(item, item.grading["canonical_solution"]).passed:
            failed.append(item.id)
        if i % 40 == 0:
            say(f"humaneval: {i}/{len(items)}")
    seconds = time.perf_counter() - started
    return {"humaneval_solutions": len(items), "humaneval_failed": failed, "humaneval_s": round(seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.sandbox", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50, help="timed runs of each program in each mode (default 50)")
    p.add_argument("--no-humaneval", action="store_true", help="skip the 164 canonical solutions")
    args = p.parse_args()
    status = jail_status()
    if not status.available:
        raise SystemExit(f"no jail on this machine: {status.reason}")
    say("jail: " + "; ".join(f"{k} {v}" for k, v in status.layers.items()))
    result: dict[str, object] = {"cpu": platform.processor() or platform.machine(), "runs": args.runs}
    result["layers"] = dict(status.layers)
    result |= timings(args.runs)
    if not args.no_humaneval:
        result |= humaneval()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
