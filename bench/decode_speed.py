"""Single-request decode speed and load time: our engine vs HF transformers, same process and threads.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.decode_speed [--models ...] [--dtypes bf16 fp32]

Decode tok/s = (new tokens - 1) / (time for N tokens - time for 1 token), greedy, end-of-turn ignored,
median of --runs; the baseline runs in the same process, so the ratio is what to quote. With
--first-start, also times `models fetch` into an empty home (download, verify, convert).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if "OMP_NUM_THREADS" not in os.environ:
    sys.exit("set OMP_NUM_THREADS before starting (changing torch threads mid-process distorts timings)")

import torch

from engines.checkpoints.fetch import fetch_model
from engines.engine import Engine
from engines.request import EngineRequest
from engines.sampling import SamplingParams

PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to code."}]


def ours_seconds(engine: Engine, prompt: list[int], n: int) -> float:
    engine.add_request(EngineRequest("bench", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)))
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def hf_seconds(model: torch.nn.Module, prompt: list[int], n: int) -> float:
    ids = torch.tensor([prompt])
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return time.perf_counter() - started


def decode_rate(run: Callable[[int], float], n: int, runs: int) -> tuple[float, float]:
    """(decode tok/s, time to first token in ms), medians over runs."""
    run(4)  # warm up allocator and kernels
    firsts, fulls = [], []
    for _ in range(runs):
        firsts.append(run(1))
        fulls.append(run(n))
    first, full = statistics.median(firsts), statistics.median(fulls)
    return (n - 1) / (full - first), first * 1000


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.decode_speed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"],
    )
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--first-start", action="store_true", help="also time fetching each model into an empty home")
    args = p.parse_args()
    home = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()
    threads = torch.get_num_threads()
    rows, results = [], {}
    for name in args.models:
        first_start = None
        if args.first_start:
            with tempfile.TemporaryDirectory() as empty:
                started = time.perf_counter()
                fetch_model(name, Path(empty), progress=False)
                first_start = time.perf_counter() - started
        model_dir = fetch_model(name, home, progress=False)
        for dtype in args.dtypes:
            started = time.perf_counter()
            engine = Engine.from_dir(model_dir, dtype=dtype)
            load_s = time.perf_counter() - started
            prompt = engine.tokenizer.encode_chat(PROMPT)
            ours, ttft = decode_rate(lambda n, e=engine, p=prompt: ours_seconds(e, p, n), args.tokens, args.runs)
            del engine
            hf = hf_ttft = hf_load = None
            if not args.no_hf:
                from transformers import AutoModelForCausalLM

                started = time.perf_counter()
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_torch_dtype(dtype)).eval()
                hf_load = time.perf_counter() - started
                hf, hf_ttft = decode_rate(lambda n, m=model, p=prompt: hf_seconds(m, p, n), args.tokens, args.runs)
                del model
            key = f"{name}/{dtype}"
            results[key] = {
                "load_s": round(load_s, 2),
                "hf_load_s": _r(hf_load),
                "tok_s": round(ours, 1),
                "hf_tok_s": _r(hf),
                "ratio": _r(hf and ours / hf, 2),
                "ttft_ms": round(ttft, 1),
                "hf_ttft_ms": _r(hf_ttft),
                "first_start_s": _r(first_start),
                "threads": threads,
            }
            rows.append((name, dtype, threads, results[key]))
            print(f"done {key}", file=sys.stderr, flush=True)
    header = (
        f"{'model':30} {'dtype':5} {'thr':>3} {'first start s':>13} {'load s':>7} {'HF load s':>9} "
        f"{'tok/s':>7} {'HF tok/s':>8} {'ratio':>6} {'TTFT ms':>8} {'HF TTFT':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, dtype, thr, r in rows:
        print(
            f"{name:30} {dtype:5} {thr:>3} {_s(r['first_start_s']):>13} {r['load_s']:>7} {_s(r['hf_load_s']):>9} "
            f"{r['tok_s']:>7} {_s(r['hf_tok_s']):>8} {_s(r['ratio']):>6} {r['ttft_ms']:>8} {_s(r['hf_ttft_ms']):>8}"
        )
    print(json.dumps(results))


def _torch_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _r(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


def _s(x: object) -> str:
    return "-" if x is None else str(x)


if __name__ == "__main__":
    main()
