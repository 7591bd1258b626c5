"""Quantized weights and KV: decode speed, quality and KV bytes, against llama.cpp on the original GGUF.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.quant [--models smollm2-135m-instruct qwen2.5-coder-1.5b-instruct]

For each model, in one process with the same threads:
  decode tok/s of our engine at batch 1 and 16 for bf16, int8 (calibrated) and int4 (the GGUF's own
  4-bit blocks), on our CPU kernels where they build (see the README), and of llama.cpp on the GGUF
  file at 1 and 16 parallel sequences (one context, a `llama_batch` with 16 sequence ids:
  bench/llamacpp_batched.py). Decode only: every sequence's prompt is prefilled first, then
  N sequences × (tokens - 1) greedy steps are timed, EOS ignored; the median of --repeats runs.
  perplexity on held-out text (`engines.checkpoints.quality`, 4,096 tokens) and accuracy on the first --gsm8k
  GSM8K problems for bf16, int8, int4 and bf16 weights with the int8 KV cache; KV bytes per token.
The last line is one JSON object; the headline ratios are for the last model (Qwen 1.5B by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.common import mtbench_questions, say
from bench.llamacpp_pick import measured as measured_build
from engines.checkpoints.fetch import assemble_gguf, fetch_model, registry_model
from engines.checkpoints.quality import perplexity
from engines.checkpoints.quantized import fetch_quantized
from engines.engine import Engine, EngineConfig
from engines.kv.cache import bytes_per_token
from engines.models.config import ModelConfig
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from gateway.runtime.model_quality import gsm8k_accuracy
from grading.datasets import heldout_text, load_gsm8k


def decode_tok_s(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    """Prefill every prompt, then time the greedy decode of the remaining tokens - 1 per sequence."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"d{i}", p, params))
    started: set[str] = set()
    while len(started) < len(prompts):  # prefill: until each sequence has its first token
        started |= {o.request_id for o in engine.step()}
    t0 = time.perf_counter()
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    return generated / (time.perf_counter() - t0)


def variants(name: str, home: Path) -> dict[str, Path]:
    return {
        "bf16": fetch_model(name, home),
        "int8": fetch_quantized(name, home, "int8"),
        "int4": fetch_quantized(name, home, "int4"),
    }


def bench_model(name: str, home: Path, args: argparse.Namespace, threads: int) -> dict:
    dirs = variants(name, home)
    gguf = assemble_gguf(registry_model(name), home / "gguf", progress=False)
    questions = mtbench_questions(home)
    text = heldout_text(home, progress=False)
    problems = load_gsm8k(home, args.gsm8k, progress=False) if args.gsm8k else []
    out: dict = {"model": name, "speed": {}, "quality": {}}

    engines = {v: Engine.from_dir(d) for v, d in dirs.items()}
    prompts = [engines["bf16"].tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions[:16]]
    for e in engines.values():
        decode_tok_s(e, prompts[:2], 4)  # warm-up: kernels, first-use KV blocks
    for b in () if args.skip_speed else (1, 16):
        runs: dict[str, list[float]] = {v: [] for v in engines}
        runs["llama.cpp"] = []
        for r in range(args.repeats):  # interleaved, so every system sees the same machine load
            for v, e in engines.items():
                runs[v].append(decode_tok_s(e, prompts[:b], args.tokens))
            if not args.no_llamacpp:
                from bench.llamacpp_batched import llamacpp_batched_decode

                res = llamacpp_batched_decode(gguf, prompts[:b], args.tokens, threads)
                runs["llama.cpp"].append(res["decode_tok_s"])
            say(f"  {name} batch {b} run {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items() if v))
        for v, xs in runs.items():
            if xs:
                out["speed"][f"{v}_b{b}"] = statistics.median(xs)
    for v, e in engines.items():
        out.setdefault("weight_bytes", {})[v] = sum(m.nbytes for m in e.model.modules() if hasattr(m, "kernel"))
    del engines

    cfg = None
    for v, d in [] if args.skip_quality else [*dirs.items(), ("bf16+kv8", dirs["bf16"])]:
        kv = "int8" if v.endswith("kv8") else "auto"
        e = Engine.from_dir(d, config=EngineConfig(kv_cache_dtype=kv))
        cfg = e.model.config
        t0 = time.perf_counter()
        ppl = perplexity(e, e.tokenizer.encode(text)[: args.ppl_tokens])
        acc = gsm8k_accuracy(e, problems, max_tokens=args.gsm8k_tokens)[0] if problems else None
        out["quality"][v] = {"ppl": ppl, "gsm8k": acc}
        say(f"  {name} {v}: ppl {ppl:.4f}, gsm8k {acc}, {time.perf_counter() - t0:.0f} s")
        del e
    cfg = cfg or ModelConfig.from_dir(dirs["bf16"])
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    out["kv_bytes_per_token"] = {
        "bf16": bytes_per_token(*shape, torch.bfloat16),
        "int8": bytes_per_token(*shape, torch.bfloat16, torch.int8),
    }
    return out


def delta_pct(q: dict, v: str) -> float:
    return 100 * (q[v]["ppl"] / q["bf16"]["ppl"] - 1)


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.quant", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"])
    p.add_argument("--tokens", type=int, default=32, help="new tokens per sequence in the speed runs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--gsm8k", type=int, default=24, help="first N GSM8K problems (0 skips)")
    p.add_argument("--gsm8k-tokens", type=int, default=256)
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--skip-speed", action="store_true", help="quality and KV bytes only")
    p.add_argument("--skip-quality", action="store_true", help="decode speed and KV bytes only")
    args = p.parse_args()
    home = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()
    threads = torch.get_num_threads()
    results = []
    for name in args.models:
        say(f"{name}: {threads} threads")
        results.append(bench_model(name, home, args, threads))

    for r in results:
        s, q = r["speed"], r["quality"]
        print(f"\n{r['model']}, OMP_NUM_THREADS={threads}, decode tok/s (median of {args.repeats})")
        print(f"{'system':<12} {'batch 1':>9} {'batch 16':>9} {'weights MB':>11}")
        for v in ("bf16", "int8", "int4", "llama.cpp"):
            if f"{v}_b1" in s:
                mb = r.get("weight_bytes", {}).get(v)
                print(f"{v:<12} {s[f'{v}_b1']:>9.1f} {s[f'{v}_b16']:>9.1f} {mb / 1e6 if mb else float('nan'):>11.1f}")
        print(f"{'variant':<12} {'perplexity':>10} {'Δ%':>7} {'gsm8k':>7}")
        for v, m in q.items():
            acc = "" if m["gsm8k"] is None else f"{m['gsm8k']:.3f}"
            print(f"{v:<12} {m['ppl']:>10.4f} {delta_pct(q, v):>+7.2f} {acc:>7}")
        kv = r["kv_bytes_per_token"]
        print(f"KV bytes per token: bf16 {kv['bf16']}, int8 {kv['int8']} ({kv['int8'] / kv['bf16']:.3f}x)")

    last = results[-1]
    s, q = last["speed"], last["quality"]
    llama = s.get("llama.cpp_b1"), s.get("llama.cpp_b16")
    summary: dict = {"model": last["model"], "threads": threads, "llamacpp_build": measured_build()}
    if s:
        best16 = max(s[f"{v}_b16"] for v in ("bf16", "int8", "int4"))
        summary |= {
            "int8_speedup_b1": round(s["int8_b1"] / s["bf16_b1"], 2),
            "int4_speedup_b1": round(s["int4_b1"] / s["bf16_b1"], 2),
            "int4_vs_llamacpp_b1": round(s["int4_b1"] / llama[0], 2) if llama[0] else None,
            "best_vs_llamacpp_b16": round(best16 / llama[1], 2) if llama[1] else None,
        }
    if q:
        summary |= {
            "int8_ppl_delta_pct": round(delta_pct(q, "int8"), 2),
            "int4_ppl_delta_pct": round(delta_pct(q, "int4"), 2),
            "kv8_ppl_delta_pct": round(delta_pct(q, "bf16+kv8"), 2),
        }
    summary |= {
        "kv8_bytes_ratio": round(last["kv_bytes_per_token"]["int8"] / last["kv_bytes_per_token"]["bf16"], 3),
        "per_model": {
            r["model"]: {k: round(v, 1) for k, v in r["speed"].items()}
            | {f"{v}_ppl": round(m["ppl"], 4) for v, m in r["quality"].items()}
            | {f"{v}_gsm8k": m["gsm8k"] for v, m in r["quality"].items()}
            for r in results
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
