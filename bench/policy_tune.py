"""Policy tuning on GSM8K and MT-bench with the configured tiers (Qwen2.5-Coder 0.5B / 1.5B int8 by default).

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.policy_tune [--gsm8k 30] [--mtbench 30] [--max-tokens 384]

A tenant whose apps set no sampling parameters (the API's defaults: temperature 1, top-p 1, no
instruction) runs on the small tier. Its prompts are a mix of GSM8K problems (graded by their final
number) and MT-bench first turns (graded by the large tier as a blind judge, 1-9 from its digit
probabilities). Two disjoint seeded samples of each: `policies.tuning` picks the proposal on the first
(every candidate of the default grid), and the baseline and the proposal are then run for real (the
proposal's cap as the engine's max_tokens, not a cut) on the second, held-out one, so the winner of many
candidates is not judged on the sample that picked it.

Prints the tuning's table, then the held-out comparison per data set, then one JSON line:
`token_reduction` (1 - tuned / baseline completion tokens per answer, held out), `quality_delta` (tuned -
baseline, paired per prompt, 0-1 scale), `quality_ci` (its bootstrap 95% interval), with the same per data set.
Writes the tuning's plot to `--plot` (default `~/.cache/switchboard/bench-policy-tune.png`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from bench.common import THREADS, say  # also checks OMP_NUM_THREADS


def _split(items: list, n: int, seed: int) -> tuple[list, list]:
    from grading.datasets import sample

    picked = sample(items, 2 * n, seed)
    return picked[0::2], picked[1::2]


async def _held_out(policy, prompts, engines, grade, max_tokens, tag):  # noqa: ANN001, ANN202
    from policies.tuning import answer_all
    from verifiers.policy import tuning_hook

    answers = await answer_all(policy, prompts, engines, max_tokens, tag, tuning_hook)
    quality = await grade([(a.prompt, a.text) for a in answers])
    return answers, quality


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.policy_tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gsm8k", type=int, default=30, help="GSM8K problems per split (tuning, held out)")
    p.add_argument("--mtbench", type=int, default=30, help="MT-bench questions per split (at most 40)")
    p.add_argument("--max-tokens", type=int, default=384, help="what each request asks for")
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=Path("~/.cache/switchboard/bench-policy-tune.png"))
    args = p.parse_args()

    import numpy as np

    from core.settings import Settings
    from gateway.runtime.tiers import load_engines
    from grading.datasets import load_gsm8k_items, load_mtbench_items
    from policies.policy import Policy
    from policies.tune_quality import Judge, grader
    from policies.tune_report import plot_png, table
    from policies.tuning import TunePrompt, paired_interval, tune
    from verifiers.policy import tuning_hook

    settings = Settings()
    home = settings.home_dir
    prompts: dict[str, tuple[list[TunePrompt], list[TunePrompt]]] = {}
    for name, loader, n in (("gsm8k", load_gsm8k_items, args.gsm8k), ("mtbench", load_mtbench_items, args.mtbench)):
        items = loader(home)
        tune_items, eval_items = _split(items, min(n, len(items) // 2), args.seed)
        grade_as = "gsm8k" if name == "gsm8k" else "judge"
        tunes, evals = ([TunePrompt(i.id, i.messages, "small", grade_as, i.grading) for i in part]
                        for part in (tune_items, eval_items))  # fmt: skip
        prompts[name] = (tunes, evals)
    tuning_set = [q for pair in prompts.values() for q in pair[0]]
    held_out = [q for pair in prompts.values() for q in pair[1]]
    say(f"loading the tiers; {len(tuning_set)} prompts to tune on, {len(held_out)} held out")
    engines = load_engines(settings)
    for engine in set(engines.values()):
        engine.start()
    grade = grader(Judge(engines["large"]))
    started = time.perf_counter()

    async def run():  # noqa: ANN202
        tuning = await tune(Policy(), tuning_set, engines, grade, hooks=tuning_hook, max_tokens=args.max_tokens,
                            tolerance=args.tolerance, progress=say, seed=args.seed)  # fmt: skip
        say(f"tuned in {time.perf_counter() - started:.0f} s: {tuning.chosen}; running the held-out prompts")
        base = await _held_out(Policy(), held_out, engines, grade, args.max_tokens, "held-base")
        tuned = await _held_out(tuning.policy, held_out, engines, grade, args.max_tokens, "held-tuned")
        return tuning, base, tuned

    try:
        tuning, (base_answers, base_q), (tuned_answers, tuned_q) = asyncio.run(run())
    finally:
        for engine in set(engines.values()):
            engine.shutdown()
    report = tuning.as_dict()
    print(f"Tuning sample ({len(tuning_set)} prompts: {args.gsm8k} GSM8K + {args.mtbench} MT-bench), small tier, "
          f"OMP_NUM_THREADS={THREADS}")  # fmt: skip
    print(table(report))
    plot = args.plot.expanduser()
    plot.parent.mkdir(parents=True, exist_ok=True)
    plot.write_bytes(plot_png(report, "Policy tuning: GSM8K + MT-bench, small tier"))
    print(f"plot: {plot}")

    def summary(source: str | None) -> dict:
        idx = [i for i, q in enumerate(held_out) if source is None or q.id.startswith(f"{source}/")]
        bt = np.array([len(base_answers[i].token_ids) for i in idx], dtype=float)
        tt = np.array([len(tuned_answers[i].token_ids) for i in idx], dtype=float)
        bq, tq = np.array([base_q[i] for i in idx]), np.array([tuned_q[i] for i in idx])
        low, high = paired_interval(tq - bq, args.seed)
        return {
            "prompts": len(idx),
            "baseline_tokens": round(float(bt.mean()), 1),
            "tuned_tokens": round(float(tt.mean()), 1),
            "token_reduction": round(1 - float(tt.mean() / bt.mean()), 4),
            "baseline_quality": round(float(bq.mean()), 4),
            "tuned_quality": round(float(tq.mean()), 4),
            "quality_delta": round(float((tq - bq).mean()), 4),
            "quality_ci": [round(low, 4), round(high, 4)],
        }

    rows = {"gsm8k": summary("gsm8k"), "mtbench": summary("mtbench"), "all": summary(None)}
    print(f"\nHeld out ({len(held_out)} other prompts): the current policy against the proposal, {tuning.chosen}")
    print(f"{'data':8} {'n':>4} {'tokens/answer':>15} {'reduction':>10} {'quality':>15} {'Δ':>7} {'95% CI':>18}")
    for name, r in rows.items():
        ci = f"[{r['quality_ci'][0]:+.3f}, {r['quality_ci'][1]:+.3f}]"
        tokens = f"{r['baseline_tokens']:7.1f} → {r['tuned_tokens']:5.1f}"
        quality = f"{r['baseline_quality']:6.3f} → {r['tuned_quality']:5.3f}"
        delta = f"{r['quality_delta']:+7.3f}"
        print(f"{name:8} {r['prompts']:4} {tokens} {r['token_reduction']:10.1%} {quality} {delta} {ci:>18}")
    out = {
        "token_reduction": rows["all"]["token_reduction"],
        "quality_delta": rows["all"]["quality_delta"],
        "quality_ci": rows["all"]["quality_ci"],
        "chosen": tuning.chosen,
        "changes": dict(tuning.proposal.changes),
        "tuning_token_reduction": report["token_reduction"],
        "tuning_quality_delta": report["quality_delta"],
        "per_source": {k: v for k, v in rows.items() if k != "all"},
        "seconds": round(time.perf_counter() - started),
        "threads": THREADS,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
