"""Engine throughput: our batched engine vs HF transformers and llama.cpp, on an MT-bench workload.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.engine_throughput [--model smollm2-135m-instruct] [--dtype bf16]

Workload: the 80 MT-bench first-turn questions (from the registry package the README names), chat-
templated, each with an output length drawn from --min-tokens..--max-tokens (seeded); end-of-turn is
suppressed everywhere so every system generates exactly the same number of tokens. Throughput is
generated tokens / wall time, prefill included.

  (a) HF transformers `generate`, one request at a time        (b) our engine at concurrency 1, 4, 16, 32
  (c) TTFT of a request behind a shared ~1,000-token system prompt, cold vs prefix-cached
  (d) our engine at concurrency 16 with prefix caching on vs off, every request with its own cache
      salt so the hit rate is 0%: the bookkeeping's cost, both engines stepped in lockstep
  (e) llama.cpp (llama-cpp-python, the build bench/llamacpp_pick.py chooses) on the original GGUF, one request at a time

One-at-a-time systems (a, b at concurrency 1, e) run the first --sequential-requests requests; the
batched runs use all of --requests. The last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.common import MTBENCH, say
from bench.llamacpp_pick import measured as measured_build
from engines.checkpoints.fetch import assemble_gguf, fetch_model, fetch_package_file, registry_model
from engines.engine import Engine
from engines.request import EngineRequest
from engines.sampling import SamplingParams

SYSTEM_PROMPT_WORDS = (
    "You are the support assistant of Northwind Hardware. Follow the store policy below exactly. "
    "Returns are accepted within thirty days with a receipt; power tools must be unused and in their box. "
    "Orders above fifty dollars ship free; express shipping costs twelve dollars and arrives in two days. "
    "Never promise a delivery date, never share another customer's order, and always answer briefly. "
)


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int


def workload(engine: Engine, home: Path, n: int, lo: int, hi: int, seed: int) -> list[Job]:
    path = fetch_package_file(*MTBENCH, home)
    questions = [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    rng.shuffle(questions)
    return [
        Job(engine.tokenizer.encode_chat([{"role": "user", "content": q}]), rng.randint(lo, hi))
        for q in (questions * (n // len(questions) + 1))[:n]
    ]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def admit(engine: Engine, pending: deque[tuple[int, Job]], concurrency: int, salt: Callable[[int], str]) -> list[str]:
    """Top the engine up to `concurrency` running requests from `pending`; returns the ids added."""
    added = []
    while pending and engine.num_running < concurrency:
        i, job = pending.popleft()
        engine.add_request(EngineRequest(f"j{i}", job.prompt, params(job.max_tokens), cache_salt=salt(i)))
        added.append(f"j{i}")
    return added


def run_ours(engine: Engine, jobs: list[Job], concurrency: int, salt: Callable[[int], str] = lambda i: "") -> dict:
    """Closed loop: keep `concurrency` requests in the engine until all jobs are done."""
    pending = deque(enumerate(jobs))
    started: dict[str, float] = {}
    ttft: list[float] = []
    generated = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        for rid in admit(engine, pending, concurrency, salt):
            started[rid] = time.perf_counter()
        for out in engine.step():
            generated += len(out.new_token_ids)
            if out.completion_tokens == 1:
                ttft.append(time.perf_counter() - started[out.request_id])
    wall = time.perf_counter() - t0
    return {"tok_s": generated / wall, "ttft_ms": statistics.median(ttft) * 1000, "tokens": generated}


def run_hf(model_dir: Path, dtype: torch.dtype, jobs: list[Job]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    def one(job: Job) -> None:
        with torch.inference_mode():
            model.generate(
                torch.tensor([job.prompt]),
                max_new_tokens=job.max_tokens,
                min_new_tokens=job.max_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    one(Job(jobs[0].prompt, 4))  # warm-up
    t0 = time.perf_counter()
    for job in jobs:
        one(job)
    return sum(j.max_tokens for j in jobs) / (time.perf_counter() - t0)


def run_llamacpp(gguf: Path, threads: int, jobs: list[Job], eos_ids: frozenset[int]) -> float | None:
    from bench.llamacpp_pick import load  # the fastest build that runs here correctly; it says which (stderr)

    ctx = max(len(j.prompt) + j.max_tokens for j in jobs) + 16
    llm = load(gguf, threads, say).Llama(
        model_path=str(gguf), n_ctx=ctx, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    no_eos = {int(t): -float("inf") for t in eos_ids}

    def one(job: Job) -> int:
        out = llm.create_completion(job.prompt, max_tokens=job.max_tokens, temperature=0.0, logit_bias=no_eos)
        return out["usage"]["completion_tokens"]

    one(Job(jobs[0].prompt, 4))
    t0 = time.perf_counter()
    generated = sum(one(job) for job in jobs)
    return generated / (time.perf_counter() - t0)


def ttft_shared_prefix(engine: Engine, runs: int) -> tuple[float, float]:
    """Median TTFT (ms) of a request behind a ~1,000-token system prompt: cold, then cached."""
    system = SYSTEM_PROMPT_WORDS * 100
    tok = engine.tokenizer
    while len(tok.encode(system)) > 1000:
        system = system[: int(len(system) * 0.95)]

    def first_token_ms(question: str, salt: str) -> float:
        prompt = tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": question}])
        engine.add_request(EngineRequest("ttft", prompt, params(1), cache_salt=salt))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return (time.perf_counter() - t0) * 1000

    cold, cached = [], []
    for i in range(runs):
        cold.append(first_token_ms(f"Question {i}: can I return a drill?", salt=f"cold-{i}"))
        cached.append(first_token_ms(f"Question {i}: how much is express shipping?", salt=f"cold-{i}"))
    return statistics.median(cold), statistics.median(cached)


def prefix_cache_cost(
    engine: Engine, warm_jobs: list[Job], jobs: list[Job], rounds: int
) -> tuple[float, float, float, float]:
    """(overhead %, % of step time inside prefix-cache code, tok/s on, tok/s off).

    Two new engines on the same model, caching on and off, first serve `warm_jobs` so both pools
    have the same history, then `jobs` at concurrency 16. Every request gets its own salt, so nothing
    hits and caching can only cost. The engines run in lockstep, one step each in alternating order,
    and only their steps are timed: a shared 2-vCPU box drifts by +-20% between whole runs, far more
    than the effect measured, but two steps a few milliseconds apart see the same machine. The
    overhead is the median over rounds of (time on / time off - 1); the direct share times the
    hashing, matching and registering code itself.
    """
    on_engine, off_engine = (
        Engine(engine.model, engine.tokenizer, replace(engine.config, enable_prefix_caching=flag))
        for flag in (True, False)
    )
    bm = on_engine.block_manager
    spent = [0.0]

    def timed(fn: Callable) -> Callable:
        def wrapper(*a: object, **kw: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t0

        return wrapper

    unique = lambda i: f"unique-{time.monotonic_ns()}-{i}"  # noqa: E731 - never hits
    lockstep([on_engine, off_engine], warm_jobs, 32, unique)
    bm.match_prefix = timed(bm.match_prefix)  # type: ignore[method-assign]
    bm.cache_full_blocks = timed(bm.cache_full_blocks)  # type: ignore[method-assign]
    overheads, seconds_on, seconds_off, tokens = [], 0.0, 0.0, 0
    for _ in range(rounds):
        (on, generated), (off, _) = lockstep([on_engine, off_engine], jobs, 16, unique)
        overheads.append((on / off - 1) * 100)
        seconds_on, seconds_off, tokens = seconds_on + on, seconds_off + off, tokens + generated
    return statistics.median(overheads), spent[0] / seconds_on * 100, tokens / seconds_on, tokens / seconds_off


def lockstep(
    engines: list[Engine], jobs: list[Job], concurrency: int, salt: Callable[[int], str]
) -> list[tuple[float, int]]:
    """Run `jobs` closed-loop on every engine at once, a step of each in turn (first and second swap
    each round); returns each engine's (seconds inside add_request and step, tokens generated)."""
    pending = [deque(enumerate(jobs)) for _ in engines]
    seconds = [0.0] * len(engines)
    generated = [0] * len(engines)
    turn = 0
    while any(pending) or any(e.has_unfinished() for e in engines):
        order = range(len(engines)) if turn % 2 == 0 else reversed(range(len(engines)))
        for k in order:
            engine = engines[k]
            t0 = time.perf_counter()
            admit(engine, pending[k], concurrency, salt)
            generated[k] += sum(len(out.new_token_ids) for out in engine.step())
            seconds[k] += time.perf_counter() - t0
        turn += 1
    return list(zip(seconds, generated, strict=True))


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--requests", type=int, default=64, help="requests in the batched runs")
    p.add_argument("--sequential-requests", type=int, default=12, help="requests in the one-at-a-time runs")
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--rounds", type=int, default=7, help="lockstep rounds of the prefix-cache on/off comparison")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-llamacpp", action="store_true")
    args = p.parse_args()
    home = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()
    threads = torch.get_num_threads()
    model_dir = fetch_model(args.model, home)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    engine = Engine.from_dir(model_dir, dtype=args.dtype)
    jobs = workload(engine, home, args.requests, args.min_tokens, args.max_tokens, args.seed)
    seq_jobs = jobs[: args.sequential_requests]
    say(
        f"{args.model} {args.dtype}, {threads} threads: {len(jobs)} requests, prompts "
        f"{min(len(j.prompt) for j in jobs)}-{max(len(j.prompt) for j in jobs)} tokens, outputs "
        f"{args.min_tokens}-{args.max_tokens}; one-at-a-time runs use the first {len(seq_jobs)}"
    )
    run_ours(engine, jobs[:4], 4)  # warm-up: allocator, kernels, first-use KV blocks
    rows: list[tuple[str, str, str]] = []
    result: dict[str, float | int | str | None] = {"model": args.model, "dtype": args.dtype, "threads": threads}

    hf = None
    if not args.no_hf:
        say("(a) HF transformers generate, one request at a time ...")
        hf = run_hf(model_dir, dtype, seq_jobs)
        rows.append(("(a) HF transformers generate, c=1", f"{hf:.1f}", ""))
    result["tok_s_hf"] = round(hf, 1) if hf else None

    ours: dict[int, dict] = {}
    for c in args.concurrency:
        say(f"(b) our engine at concurrency {c} ...")
        ours[c] = run_ours(engine, seq_jobs if c == 1 else jobs, c)
        ratio = f"{ours[c]['tok_s'] / hf:.2f}x HF" if hf else ""
        rows.append((f"(b) switchboard engine, c={c}", f"{ours[c]['tok_s']:.1f}", ratio))
        result[f"tok_s_c{c}"] = round(ours[c]["tok_s"], 1)

    llama = None
    if not args.no_llamacpp:
        say("(e) llama.cpp on the original GGUF, one request at a time ...")
        gguf = assemble_gguf(registry_model(args.model), home / "gguf", progress=False)
        llama = run_llamacpp(gguf, threads, seq_jobs, engine.tokenizer.eos_token_ids)
        if llama:
            rows.append((f"(e) llama.cpp {gguf.name}, c=1", f"{llama:.1f}", f"{llama / hf:.2f}x HF" if hf else ""))
    result["tok_s_llamacpp"] = round(llama, 1) if llama else None
    result["llamacpp_build"] = measured_build()

    say("(c) TTFT behind a shared 1,000-token system prompt, cold vs cached ...")
    cold, cached = ttft_shared_prefix(engine, runs=5)
    rows.append(("(c) TTFT, 1,000-token shared prefix, cold", f"{cold:.0f} ms", ""))
    rows.append(("(c) TTFT, same prefix cached", f"{cached:.0f} ms", f"{cold / cached:.1f}x faster"))

    say("(d) prefix caching on vs off at a 0% hit rate, concurrency 16 ...")
    overhead, share, on_med, off_med = prefix_cache_cost(engine, jobs, jobs[:16], args.rounds)
    rows.append(("(d) c=16, prefix caching off", f"{off_med:.1f}", ""))
    rows.append(("(d) c=16, prefix caching on, 0% hits", f"{on_med:.1f}", f"{overhead:+.1f}% (lockstep median)"))
    rows.append(("(d) time in prefix-cache code, caching on", f"{share:.2f}%", "of step time, measured directly"))

    result.update(
        ratio_c16_vs_hf=round(ours[16]["tok_s"] / hf, 2) if hf and 16 in ours else None,
        ratio_c1_vs_hf=round(ours[1]["tok_s"] / hf, 2) if hf and 1 in ours else None,
        ratio_c32_vs_llamacpp=round(ours[32]["tok_s"] / llama, 2) if llama and 32 in ours else None,
        ttft_cold_ms=round(cold, 1),
        ttft_cached_ms=round(cached, 1),
        prefix_overhead_pct=round(overhead, 2),
        prefix_code_share_pct=round(share, 3),
    )
    width = max(len(r[0]) for r in rows)
    print(f"\n{args.model} {args.dtype}, OMP_NUM_THREADS={threads}, output tok/s (generated tokens / wall time)")
    print(f"{'run':<{width}}  {'tok/s':>10}  vs")
    print("-" * (width + 30))
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10}  {note}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
