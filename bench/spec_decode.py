"""Speculative decoding on the large tier: plain vs draft-model vs n-gram proposals, batch 1 and 8.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.spec_decode [--prompts 6] [--tokens 96]

Target: Qwen2.5-Coder-1.5B (int8 weights, as the large tier serves on this CPU); draft:
Qwen2.5-Coder-0.5B. Prompts: the first --prompts MT-bench first turns and GSM8K test problems,
chat-templated. Greedy, stopping at end of turn, so the texts are real answers. Every configuration
decodes the same prompts in one process, interleaved: each wave of prompts runs on every engine in
turn (a shared 2-vCPU machine drifts by 20% over minutes, more than the effects measured); speculative
outputs are checked to equal the plain ones.

Decode tok/s = generated tokens after each wave's first tokens / seconds after them (prefill is not
timed; where speculation is expected to pay, the draft computes the prompt in the prefill step, which
adds about a third to it). Each engine serves one short request first, as a running server has timed
its steps before: adaptive k decides from measured costs.

First a lever table at batch 1 (each lever added to the one above: naive int8 draft at fixed k, an
int4 draft, its head cut to the 32k most frequent tokens, adaptive k), then the main table: plain,
the full draft configuration and n-gram at batch 1 and 8. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

from bench.common import mtbench_questions, say
from engines.checkpoints.fetch import fetch_model
from engines.checkpoints.loader import load_model
from engines.checkpoints.quantized import fetch_quantized
from engines.engine import Engine, EngineConfig
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from engines.speculative.speculator import SpeculativeConfig
from gateway.runtime.model_quality import gsm8k_prompt
from grading.datasets import load_gsm8k

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def decode_wave(engine: Engine, wave: list[list[int]], tokens: int) -> tuple[int, float, list[list[int]]]:
    """(tokens generated after each first token, seconds from the last first token to the last finish,
    outputs) for one wave of prompts decoded together."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(wave):
        rid = f"w{i}-{time.monotonic_ns()}"
        out[rid] = []
        engine.add_request(EngineRequest(rid, p, SamplingParams(max_tokens=tokens, temperature=0.0)))
    first: dict[str, float] = {}
    done_at: dict[str, float] = {}
    while engine.has_unfinished():
        for o in engine.step():
            now = time.perf_counter()
            out[o.request_id] += o.new_token_ids
            first.setdefault(o.request_id, now)
            if o.finished:
                done_at[o.request_id] = now
    return sum(len(v) - 1 for v in out.values()), max(done_at.values()) - max(first.values()), list(out.values())


def decode(
    engines: dict[str, Engine], prompts: list[list[int]], batch: int, tokens: int
) -> dict[str, tuple[float, list[list[int]]]]:
    """Per engine (decode tok/s, outputs): prompts in waves of `batch`, each wave run on every engine in
    turn (the order rotating), so a shared machine's drift falls on all of them alike."""
    names = list(engines)
    generated = dict.fromkeys(names, 0)
    seconds = dict.fromkeys(names, 0.0)
    outputs: dict[str, list[list[int]]] = {n: [] for n in names}
    for w, lo in enumerate(range(0, len(prompts), batch)):
        for name in names[w % len(names) :] + names[: w % len(names)]:
            n, sec, outs = decode_wave(engines[name], prompts[lo : lo + batch], tokens)
            generated[name] += n
            seconds[name] += sec
            outputs[name] += outs
    return {n: (generated[n] / seconds[n], outputs[n]) for n in names}


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.spec_decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=6, help="MT-bench questions and as many GSM8K problems")
    p.add_argument("--tokens", type=int, default=96, help="most generated tokens per prompt")
    p.add_argument("--k", type=int, default=4, help="most drafts per step")
    p.add_argument("--draft-vocab", type=int, default=32768, help="draft head: ids below this, plus specials")
    p.add_argument("--skip-levers", action="store_true")
    p.add_argument("--distilled", type=Path, help="a distilled draft (`switchboard models distill`) to compare")
    p.add_argument("--home", type=Path, default=Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")))
    args = p.parse_args()
    home = args.home.expanduser()
    threads = int(os.environ["OMP_NUM_THREADS"])

    say("models: quantized checkpoints (made once)")
    target_dir = fetch_quantized(TARGET, home, "int8")
    drafts = {fmt: load_model(fetch_quantized(DRAFT, home, fmt), "bf16") for fmt in ("int8", "int4")}
    if args.distilled:  # both quantized the same way from float weights, so only distillation differs
        drafts["original, int4 from bf16"] = load_model(fetch_model(DRAFT, home), "bf16", "int4")
        drafts["distilled"] = load_model(args.distilled, "bf16", "int4")
    plain = Engine.from_dir(target_dir, config=EngineConfig(kv_cache_bytes=256 << 20))
    tok = plain.tokenizer
    questions = mtbench_questions(home)
    prompt_sets = {
        "mt-bench": [tok.encode_chat([{"role": "user", "content": q}]) for q in questions[: args.prompts]],
        "gsm8k": [gsm8k_prompt(plain, pr["question"]) for pr in load_gsm8k(home, args.prompts, progress=False)],
    }
    prompts = [pr for ps in prompt_sets.values() for pr in ps]

    def engine(spec: SpeculativeConfig, draft_fmt: str = "int8") -> Engine:
        config = EngineConfig(kv_cache_bytes=256 << 20, speculative=spec)
        e = Engine(plain.model, tok, config, draft_model=drafts[draft_fmt] if spec.method == "draft" else None)
        decode_wave(e, prompts[-1:], 16)  # warm-up: a serving engine has timed its steps before
        return e

    fixed = SpeculativeConfig(method="draft", num_speculative_tokens=args.k, adaptive=False)
    full = replace(fixed, adaptive=True, draft_vocab=args.draft_vocab)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=args.k)
    decode_wave(plain, prompts[:1], 4)  # warm-up: kernels, first-use blocks
    results: dict[str, dict] = {}
    for batch in (1, 8):
        configs: dict[str, tuple[SpeculativeConfig, str]] = {}
        if batch == 1 and not args.skip_levers:
            configs["draft int8, fixed k"] = (fixed, "int8")
            configs["+ int4 draft"] = (fixed, "int4")
            configs["+ 32k-token draft head"] = (replace(fixed, draft_vocab=args.draft_vocab), "int4")
        configs["draft"] = (full, "int4")
        if batch == 1 and args.distilled:  # fixed k: acceptance is what distillation changes
            headed = replace(fixed, draft_vocab=args.draft_vocab)
            configs["fixed k, int4 from bf16"] = (headed, "original, int4 from bf16")
            configs["fixed k, distilled"] = (headed, "distilled")
        configs["ngram"] = (ngram, "int8")
        engines = {"plain": plain} | {label: engine(*c) for label, c in configs.items()}
        say(f"batch {batch}: {', '.join(engines)}, interleaved by wave")
        measured = decode(engines, prompts, batch, args.tokens)
        base, reference = measured["plain"]
        if batch == 8:
            assert reference == results["plain b1"]["outputs"], "plain greedy output changed with the batch"
        results[f"plain b{batch}"] = {"tok_s": base, "outputs": reference}
        for label, e in engines.items():
            if label == "plain":
                continue
            tok_s, outs = measured[label]
            st = e.stats().speculative
            results[f"{label} b{batch}"] = {
                "tok_s": tok_s,
                "speedup": tok_s / base,
                "acceptance": st.get("spec_acceptance_rate", 0.0),
                "accepted_len": st.get("spec_mean_accepted_length", 0.0),
                "identical": outs == reference,
                "k_chosen": dict(sorted(e.speculator.stats.by_k.items())) if e.speculator else {},
            }
        del engines
    base1 = results["plain b1"]["tok_s"]

    print(
        f"\nQwen2.5-Coder-1.5B int8 target, Qwen2.5-Coder-0.5B draft; {len(prompts)} prompts "
        f"({args.prompts} MT-bench + {args.prompts} GSM8K), ≤{args.tokens} tokens, OMP_NUM_THREADS={threads}"
    )
    print(f"{'configuration':32} {'tok/s':>7} {'speedup':>8} {'accept':>7} {'kept/step':>9} {'same text':>9}  k chosen")
    for label, r in results.items():
        if "speedup" not in r:
            print(f"{label:32} {r['tok_s']:7.2f} {'1.00x':>8}")
            continue
        print(
            f"{label:32} {r['tok_s']:7.2f} {r['speedup']:7.2f}x {r['acceptance']:7.3f} {r['accepted_len']:9.2f} "
            f"{'yes' if r['identical'] else 'NO':>9}  {r['k_chosen']}"
        )
    summary = {
        "tok_s_plain_b1": round(base1, 2),
        "tok_s_draft_b1": round(results["draft b1"]["tok_s"], 2),
        "speedup_draft_b1": round(results["draft b1"]["speedup"], 3),
        "speedup_ngram_b1": round(results["ngram b1"]["speedup"], 3),
        "speedup_draft_b8": round(results["draft b8"]["speedup"], 3),
        "speedup_ngram_b8": round(results["ngram b8"]["speedup"], 3),
        "acceptance_rate": results["draft b1"]["acceptance"],
        "identical_outputs": all(r.get("identical", True) for r in results.values()),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
