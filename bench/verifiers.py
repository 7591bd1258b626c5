"""Verifiers on GSM8K with the configured tiers (Qwen2.5-Coder 0.5B / 1.5B int8 by default).

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.verifiers [--problems 200] [--n 8] [--out DIR]

(a) Self-consistency on the small tier: n sampled answers per problem (temperature 0.7, top-p 0.95,
    seeded), majority vote of their final numbers; then the same requests (same seeds) with the
    `Confidence` verifier in the engine's step loop, pruning the least confident traces and stopping the
    rest once the vote has converged, and a confidence-weighted vote of the traces that ended by
    themselves. Tokens are every completion token generated, pruned traces' included.
(b) Cascade: the small tier's greedy answer, escalated to the large tier when it has no final number or
    a check fails; against the large tier's greedy answer on every problem. Three checks: `confidence`,
    the answer's mean token confidence (DeepConf's, top-5) below a threshold picked on 50 *other*
    problems to escalate `--escalate-share` of them; `probe`, the learned answer probe's P(right) below
    its own threshold (retrained here on `switchboard verifiers train-probe`'s graded answers minus every
    GSM8K problem this bench uses; skipped where that command has not run); `oracle`, a perfect check of
    the small answer (the bound any check of it can reach). `cascade_acc`/`cascade_cost_ratio` are those of
    the more accurate real check (`cascade` names it). Costs use the default policy's prices (small $0.10/$0.40, large
    $0.50/$2.00 per million prompt/completion tokens); greedy decoding is deterministic, so the cascade's
    large answers are the always-large ones.

Every problem's result is appended to a JSONL file per run in `--out` (default
`~/.cache/switchboard/bench-verifiers`), so an interrupted run resumes. Accuracy is against GSM8K's
reference number. The table, then one JSON line: `sc_acc`, `sc_tokens`, `pruned_acc`, `pruned_tokens`,
`token_saving`, `cascade_acc`, `large_acc`, `cascade_cost_ratio` (tokens are means per problem).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path

from bench.common import say  # also checks OMP_NUM_THREADS
from router_model.evaluate import auc

SLOTS = 64  # sequences in an engine at once


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.verifiers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--n", type=int, default=8, help="samples per problem for self-consistency")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--escalate-share", type=float, default=0.3)
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache/switchboard/bench-verifiers")
    ap.add_argument("--parts", nargs="+", default=["sc", "cascade"], choices=["sc", "cascade"])
    args = ap.parse_args()

    from core.settings import Settings
    from gateway.runtime.tiers import load_engines
    from grading.answers import extract_answer, reference_answer
    from grading.datasets import GSM8K_INSTRUCTION, load_gsm8k

    settings = Settings()
    engines = load_engines(settings)
    small, large = engines["small"].engine, engines["large"].engine  # type: ignore[attr-defined]
    problems = load_gsm8k(settings.home_dir, args.problems + 50)
    evaluated, calibration = problems[: args.problems], problems[args.problems :]
    args.out.mkdir(parents=True, exist_ok=True)

    def prompt(engine: object, question: str) -> list[int]:
        asked = [{"role": "user", "content": f"{question}\n{GSM8K_INSTRUCTION}"}]
        return engine.tokenizer.encode_chat(asked)  # type: ignore[attr-defined]

    def expected(p: dict) -> str | None:
        return reference_answer(p["answer"])

    result: dict[str, float] = {}
    if "sc" in args.parts:

        def sc(pruned: bool) -> Callable:
            return lambda i, p: sc_jobs(small, i, p, args, prompt, pruned)

        plain = run_part(args.out / f"sc_plain_n{args.n}.jsonl", evaluated, sc(False), small, "sc plain")
        pruned = run_part(args.out / f"sc_pruned_n{args.n}.jsonl", evaluated, sc(True), small, "sc pruned")
        sc_acc, pruned_acc = accuracy(plain, evaluated, "vote"), accuracy(pruned, evaluated, "vote")
        sc_tokens, pruned_tokens = mean([r["tokens"] for r in plain]), mean([r["tokens"] for r in pruned])
        result |= {
            "sc_acc": round(sc_acc, 4), "sc_tokens": round(sc_tokens, 1),
            "pruned_acc": round(pruned_acc, 4), "pruned_tokens": round(pruned_tokens, 1),
            "token_saving": round(1 - pruned_tokens / sc_tokens, 4),
        }  # fmt: skip
    if "cascade" in args.parts:

        def greedy(engine: object) -> Callable:
            return lambda i, p: greedy_jobs(engine, i, p, args, prompt)

        small_runs = run_part(args.out / "greedy_small.jsonl", evaluated, greedy(small), small, "small")
        calib = run_part(args.out / "greedy_small_calibration.jsonl", calibration, greedy(small), small, "calibration")
        large_runs = run_part(args.out / "greedy_large.jsonl", evaluated, greedy(large), large, "large")
        confs = sorted(r["confidence"] for r in calib)
        threshold = confs[min(int(args.escalate_share * len(confs)), len(confs) - 1)]
        no_number = [extract_answer(r["text"]) is None for r in small_runs]
        small_right = [r["answer"] == expected(p) for r, p in zip(small_runs, evaluated, strict=True)]
        rules = {"confidence": [n or r["confidence"] < threshold for n, r in zip(no_number, small_runs, strict=True)]}
        probe = answer_probe(settings, args.problems + len(calibration))
        if probe is not None:
            p_right = probe.p_correct([(f"{p['question']}\n{GSM8K_INSTRUCTION}", r["text"]) for r, p in
                                       zip(small_runs, evaluated, strict=True)])  # fmt: skip
            cut = probe.metadata["threshold"]
            rules["probe"] = [n or float(q) < cut for n, q in zip(no_number, p_right, strict=True)]
            result["probe_auc"] = round(auc(small_right, p_right), 4)
        rules["oracle"] = [not right for right in small_right]  # a perfect check of the small answer
        result |= {
            "small_acc": round(accuracy(small_runs, evaluated, "answer"), 4),
            "large_acc": round(accuracy(large_runs, evaluated, "answer"), 4),
            "confidence_threshold": round(threshold, 4),
        }
        for name, escalate in rules.items():
            acc, ratio = cascade(small_runs, large_runs, evaluated, escalate)
            result |= {f"cascade_{name}_acc": round(acc, 4), f"cascade_{name}_cost_ratio": round(ratio, 4),
                       f"cascade_{name}_escalated": round(mean(escalate), 4)}  # fmt: skip
        chosen = max((n for n in rules if n != "oracle"), key=lambda n: result[f"cascade_{n}_acc"])  # the better check
        result |= {"cascade": chosen, "cascade_acc": result[f"cascade_{chosen}_acc"],
                   "cascade_cost_ratio": result[f"cascade_{chosen}_cost_ratio"]}  # fmt: skip
    print("| metric | value |\n|---|---:|")
    for k, v in result.items():
        print(f"| {k} | {v} |")
    print(json.dumps({"problems": args.problems, "n": args.n, **result}))


def answer_probe(settings: object, skip: int) -> object | None:
    """The answer probe, retrained here on `switchboard verifiers train-probe`'s graded answers minus any
    GSM8K problem this bench uses (the first `skip`); None where that command has not run."""
    from router_model.encoder import RouterEncoder
    from router_model.label import tier_model
    from verifiers.probe_data import ANSWERS_FILE, answered, train_from_answers

    path = settings.probe_path / ANSWERS_FILE  # type: ignore[attr-defined]
    rows = list(answered(path, tier_model(settings.tiers["small"])).values()) if path.exists() else []  # type: ignore[attr-defined]
    if not rows:
        say(f"no probe answers at {path}: run `switchboard verifiers train-probe` for the probe cascade")
        return None
    used = {f"gsm8k/{i}" for i in range(skip)}
    probe = train_from_answers(rows, RouterEncoder(), exclude=used.__contains__)
    say(f"probe: {probe.metadata['n_train']} answers, out-of-fold AUC {probe.metadata['cv_auc']:.3f}")
    return probe


def cascade(small: list[dict], large: list[dict], problems: list[dict], escalate: list[bool]) -> tuple[float, float]:
    """Accuracy and cost against always-large of answering on the small tier and escalating where told.
    Costs use the default policy's prices; an escalated problem pays for both answers."""
    from grading.answers import reference_answer
    from policies.policy import DEFAULT_PRICES

    def cost(r: dict, tier: str) -> Decimal:
        price = DEFAULT_PRICES[tier]
        return (r["prompt_tokens"] * price.prompt + r["completion_tokens"] * price.completion) / 1_000_000

    right, spent, always_large = [], Decimal(0), Decimal(0)
    for s, lg, p, up in zip(small, large, problems, escalate, strict=True):
        always_large += cost(lg, "large")
        spent += cost(s, "small") + (cost(lg, "large") if up else 0)
        right.append((lg if up else s)["answer"] == reference_answer(p["answer"]))
    return mean(right), float(spent / always_large)


def accuracy(rows: list[dict], problems: list[dict], key: str) -> float:
    from grading.answers import reference_answer

    return mean([r[key] == reference_answer(p["answer"]) for r, p in zip(rows, problems, strict=True)])


def mean(values: list) -> float:
    return statistics.fmean(float(v) for v in values) if values else float("nan")


def sc_jobs(
    engine: object, i: int, problem: dict, args: argparse.Namespace, prompt: Callable, pruned: bool
) -> tuple[list, Callable]:
    """n seeded samples of one problem; with `pruned`, under the confidence verifier's hook."""
    from engines.request import EngineRequest
    from engines.sampling import SamplingParams
    from grading.answers import extract_answer
    from verifiers.base import Context
    from verifiers.confidence import Confidence
    from verifiers.hook import VerifierHook

    ids = [f"p{i}-{j}" for j in range(args.n)]
    tokens_in = prompt(engine, problem["question"])
    verifier = Confidence(every=16, window=32) if pruned else None
    hook = VerifierHook(verifier, Context(prompt=problem["question"]), ids)
    requests = []
    for j, rid in enumerate(ids):
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, top_p=0.95, seed=1000 * i + j)
        requests.append(EngineRequest(rid, tokens_in, params, hook=hook))

    def summarize(texts: dict[str, str], tokens: dict[str, int], reasons: dict[str, str]) -> dict:
        votes: Counter = Counter()
        for rid in ids:
            answer = extract_answer(texts[rid])
            if hook.ended_by_verifier(rid) or answer is None:
                continue  # pruned or stopped mid-way: no answer of its own
            state = hook.traces[rid].state.get("confidence")
            votes[answer] += state.mean if pruned and state is not None else 1.0
        vote = votes.most_common(1)[0][0] if votes else None
        return {"vote": vote, "tokens": sum(tokens.values()), "votes": dict(votes), "actions": len(hook.summary())}

    return requests, summarize


def greedy_jobs(engine: object, i: int, problem: dict, args: argparse.Namespace, prompt: Callable) -> tuple:
    """One greedy answer, with its tokens' top-5 logprobs for the mean confidence."""
    from engines.request import EngineRequest
    from engines.sampling import SamplingParams
    from verifiers.base import Context, Trace, Verdict, Verifier
    from verifiers.confidence import token_confidence
    from verifiers.hook import VerifierHook

    class Logprobs(Verifier):  # asks for logprobs, judges nothing
        name, every, top_logprobs = "logprobs", 0, 5

        def check(self, context: Context, traces: list[Trace]) -> list[Verdict]:
            from verifiers.base import NOT_CHECKED

            return [NOT_CHECKED] * len(traces)

    rid = f"g{i}"
    ids = prompt(engine, problem["question"])
    hook = VerifierHook(Logprobs(), Context(prompt=problem["question"]), [rid])
    request = EngineRequest(rid, ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), hook=hook)

    def summarize(texts: dict[str, str], tokens: dict[str, int], reasons: dict[str, str]) -> dict:
        from grading.answers import extract_answer

        lps = hook.traces[rid].logprobs
        conf = statistics.fmean(token_confidence(lp.top) for lp in lps) if lps else 0.0
        answer = extract_answer(texts[rid])
        return {
            "text": texts[rid],
            "answer": answer,
            "completion_tokens": tokens[rid],
            "prompt_tokens": len(ids),
            "confidence": conf,
        }

    return [request], summarize


def run_part(path: Path, problems: list[dict], jobs: Callable, engine: object, label: str) -> list[dict]:
    """Each problem's summary, from `path` where already done, else by running its requests on `engine`
    (up to SLOTS sequences at once, topped up as they finish)."""
    from tqdm import tqdm

    from engines.offline import complete_all

    done: dict[int, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["problem"]] = row
    running: dict[int, tuple] = {}  # problem → (requests, summarize, texts, tokens, reasons)
    owner: dict[str, int] = {}

    def requests() -> Iterator:
        for i in (i for i in range(len(problems)) if i not in done):
            made, summarize = jobs(i, problems[i])
            running[i] = (made, summarize, {}, {}, {})
            owner.update((r.request_id, i) for r in made)
            yield from made

    with path.open("a") as out, tqdm(total=len(problems), initial=len(done), desc=label, unit="problem") as bar:
        for c in complete_all(engine, requests(), SLOTS):  # type: ignore[arg-type]
            i = owner.pop(c.request_id)
            made, summarize, texts, tokens, reasons = running[i]
            texts[c.request_id], tokens[c.request_id] = c.text, c.completion_tokens
            reasons[c.request_id] = c.finish_reason.value
            if len(reasons) == len(made):
                del running[i]
                done[i] = {"problem": i, **summarize(texts, tokens, reasons)}
                out.write(json.dumps(done[i]) + "\n")
                out.flush()
                bar.update(1)
    return [done[i] for i in range(len(problems))]


if __name__ == "__main__":
    main()
