"""Engine speed on this CPU against llama.cpp on the same GGUF, and our int8 GEMM against torch's and oneDNN's.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.engine_speed [--repeats 3] [--spec]

One process, the same threads, every system interleaved run by run (medians of --repeats):
  gemm     Qwen 1.5B's four projection shapes (qkv 1536→2048, o 1536→1536, gate+up 1536→17920,
           down 8960→1536) at M = 16, 64 and 512 rows: our int8 GEMM as the engine calls it (bf16 in,
           activations quantized, scales and bf16 out included) against `torch._int_mm` on int8
           operands already made (the bound: no quantization, no scaling), and against oneDNN's
           int8 matmul with its weights packed for it (`torch.ao.nn.quantized.Linear` on the `onednn`
           engine, uint8 activations already quantized: the compute anchor; AMX tiles where the CPU has
           them). GOP/s = 2·M·N·K / s, all four shapes together. Also each narrower build of ours the
           CPU runs (an `amx` machine shows amx, avx512-vnni and avx2 columns).
  prefill  Qwen 1.5B, one 512-token prompt (held-out text) to its first token: our int8, bf16 and int4
           tiers against llama.cpp on the registry's Q4_K_M GGUF (n_batch 512). Each run takes its own
           window of the text (a repeated prompt would be a prefix-cache hit).
  amx      on an AMX machine, the int8 tier again with the kernels forced back to the VNNI build (the
           same engine, `SWITCHBOARD_CPU_KERNELS`), interleaved: amx_prefill_speedup, amx_b16_speedup.
  decode   greedy, EOS ignored, after every prompt's prefill (bench.quant.decode_tok_s): Qwen 1.5B
           at batch 1 and 16, SmolLM2-135M at batch 1, our bf16, int8 and int4 formats against
           llama.cpp (one context, N sequence ids: bench.llamacpp_batched).
  --spec   runs `bench.spec_decode --skip-levers` (a subprocess, after the rest) for spec_speedup_b1.
The ratios take our fastest format at each point and name it. The header names the CPU, its flags
and the kernel build (`SWITCHBOARD_CPU_KERNELS`). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from bench import timed
from bench.common import mtbench_questions, say
from bench.llamacpp_pick import measured as measured_build
from bench.quant import decode_tok_s, variants
from engines.checkpoints.fetch import assemble_gguf, registry_model
from engines.engine import Engine
from engines.kernels import cpu_kernels
from engines.kernels.cpu_info import cpu_model
from engines.kernels.quantize import quantize_int8
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from grading.datasets import heldout_text

QWEN15, SMOL = "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"
SHAPES = [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536)]  # (K, N) of Qwen 1.5B's projections
FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_int8")


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(timed(fn, repeats, warmup=1))


@contextlib.contextmanager
def kernels(variant: str | None) -> Iterator[None]:
    """Our kernels forced to `variant`'s build for the block (None: as they are)."""
    forced = os.environ.get("SWITCHBOARD_CPU_KERNELS")
    if variant is not None:
        os.environ["SWITCHBOARD_CPU_KERNELS"] = variant
    try:
        yield
    finally:
        if forced is None:
            os.environ.pop("SWITCHBOARD_CPU_KERNELS", None)
        else:
            os.environ["SWITCHBOARD_CPU_KERNELS"] = forced


def narrower_builds() -> list[str]:
    """The builds this CPU runs below the one in use, widest first (the GEMM table's extra columns)."""
    order = ["amx", "avx512-vnni", "avx2"]
    used = cpu_kernels.variant()
    return [] if used is None else [v for v in order[order.index(used) + 1 :] if cpu_kernels.supported(v)]


def onednn_int8(shapes: list[tuple[int, int]]) -> list[torch.nn.Module] | None:
    """oneDNN's int8 linear layers with weights packed for it, or None where torch has no onednn engine."""
    if "onednn" not in torch.backends.quantized.supported_engines:
        return None
    torch.backends.quantized.engine = "onednn"
    out = []
    with warnings.catch_warnings():  # torch's quantized tensors are deprecated; oneDNN's kernel is the anchor
        warnings.simplefilter("ignore")
        for k, n in shapes:
            layer = torch.ao.nn.quantized.Linear(k, n, bias_=False, dtype=torch.qint8)
            weight = torch.quantize_per_tensor(torch.randn(n, k) * 0.05, 0.05 / 64, 0, torch.qint8)
            layer.set_weight_bias(weight, None)
            layer.scale, layer.zero_point = 0.05, 0
            out.append(layer)
    return out


def bench_gemm(repeats: int) -> dict:
    """GOP/s at each M: ours (the build in use), each narrower build, torch._int_mm and oneDNN's packed int8."""
    torch.manual_seed(0)
    layers = []
    for k, n in SHAPES:
        qw = quantize_int8(torch.randn(n, k) * 0.05)
        layers.append((cpu_kernels.Int8Weights(qw), qw.q.T))  # (K, N) view: _int_mm's weight operand
    onednn = onednn_int8(SHAPES)
    out: dict = {}
    for m in (16, 64, 512):
        xs = [torch.randn(m, k, dtype=torch.bfloat16) for k, _ in SHAPES]
        xq = [torch.randint(-63, 64, (m, k), dtype=torch.int8) for k, _ in SHAPES]
        xu = [torch.quantize_per_tensor(torch.randn(m, k), 0.05, 128, torch.quint8) for k, _ in SHAPES]
        ops = sum(2 * m * n * k for k, n in SHAPES)

        def ours(xs: list[torch.Tensor] = xs, build: str | None = None) -> None:
            with kernels(build):
                for x, (w, _) in zip(xs, layers, strict=True):
                    cpu_kernels.int8_linear(x, w)

        def int_mm(xq: list[torch.Tensor] = xq) -> None:
            for x, (_, wt) in zip(xq, layers, strict=True):
                torch._int_mm(x, wt)

        def packed(xu: list[torch.Tensor] = xu) -> None:
            for x, layer in zip(xu, onednn or [], strict=True):
                layer(x)

        systems: dict[str, Callable[[], None]] = {"ours": ours}
        for build in narrower_builds():
            systems[f"{build} build"] = functools.partial(ours, xs, build)
        systems["_int_mm"] = int_mm
        if onednn is not None:
            systems["onednn int8"] = packed
        runs: dict[str, list[float]] = {name: [] for name in systems}
        for _ in range(repeats):  # interleaved
            for name, fn in systems.items():
                runs[name].append(median_seconds(fn, 3))
        out[m] = {name: ops / statistics.median(ts) / 1e9 for name, ts in runs.items()}
        say(f"  gemm M={m}: " + ", ".join(f"{k} {v:,.0f} GOP/s" for k, v in out[m].items()))
    return out


def time_to_first_token(engine: Engine, prompt: list[int]) -> float:
    engine.add_request(EngineRequest(f"p{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def bench_model(name: str, home: Path, args: argparse.Namespace, threads: int, *, prefill: bool) -> dict:
    from bench.llamacpp_batched import llamacpp_batched_decode

    dirs = variants(name, home)
    gguf = assemble_gguf(registry_model(name), home / "gguf", progress=False)
    engines = {v: Engine.from_dir(d) for v, d in dirs.items()}
    # (engine, forced build) per label: on an AMX machine the int8 tier again on the VNNI build.
    systems: dict[str, tuple[Engine, str | None]] = {v: (e, None) for v, e in engines.items()}
    if cpu_kernels.variant() == "amx":
        systems["int8 vnni"] = (engines["int8"], "avx512-vnni")
    tok = engines["bf16"].tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in mtbench_questions(home)[:16]]
    for e, build in systems.values():
        with kernels(build):
            decode_tok_s(e, prompts[:2], 4)  # warm-up: kernels, first-use KV blocks
    out: dict = {}
    batches = (1, 16) if name == QWEN15 else (1,)
    for b in batches:
        runs: dict[str, list[float]] = {v: [] for v in [*systems, "llama.cpp"]}
        for r in range(args.repeats):
            for v, (e, build) in systems.items():
                with kernels(build):
                    runs[v].append(decode_tok_s(e, prompts[:b], args.tokens))
            if not args.skip_llamacpp:
                runs["llama.cpp"].append(
                    llamacpp_batched_decode(gguf, prompts[:b], args.tokens, threads)["decode_tok_s"]
                )
            say(
                f"  {name} decode batch {b} run {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items() if v)
            )
        out[f"decode_b{b}"] = {v: statistics.median(xs) for v, xs in runs.items() if xs}
    if prefill:
        text_ids = tok.encode(heldout_text(home, progress=False))
        timed = {v: systems[v] for v in ("int8", "int8 vnni", "bf16", "int4") if v in systems}
        runs = {v: [] for v in [*timed, "llama.cpp"]}
        n = args.prefill_tokens
        for r in range(args.repeats):
            for i, (v, (e, build)) in enumerate(timed.items()):
                # A new window of the text for each run and system: a repeated prompt would be a prefix-cache hit.
                at = (r * len(timed) + i) * n
                prompt = text_ids[at : at + n]
                with kernels(build):
                    runs[v].append(len(prompt) / time_to_first_token(e, prompt))
            if not args.skip_llamacpp:
                res = llamacpp_batched_decode(gguf, [text_ids[r * n : (r + 1) * n]], 2, threads)
                runs["llama.cpp"].append(n / res["prefill_s"])
            say(f"  {name} prefill {n} run {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in runs.items() if v))
        out["prefill"] = {v: statistics.median(xs) for v, xs in runs.items() if xs}
    return out


def ratio(a: float, b: float | None) -> float | None:
    return None if b is None else round(a / b, 2)


def best(point: dict) -> tuple[str, float, float | None]:
    """(our fastest format, its rate, its ratio to llama.cpp)."""
    name, rate = max(((k, v) for k, v in point.items() if k != "llama.cpp"), key=lambda kv: kv[1])
    llama = point.get("llama.cpp")
    return name, rate, round(rate / llama, 2) if llama else None


def run_spec(args: argparse.Namespace) -> dict | None:
    say("spec: python -m bench.spec_decode --skip-levers")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.spec_decode", "--skip-levers"], capture_output=True, text=True, check=False
    )
    print(proc.stdout[-3000:])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine_speed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per sequence in the decode runs")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--skip-models", action="store_true", help="the GEMM table only")
    p.add_argument("--spec", action="store_true", help="also run bench.spec_decode --skip-levers (long)")
    args = p.parse_args()
    home = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()
    threads = torch.get_num_threads()
    flags = sorted(f for f in FLAGS if f in cpu_kernels.cpu_flags())
    say(f"{cpu_model()}, {threads} threads, flags {' '.join(flags)}, kernels {cpu_kernels.variant()}")

    gemm = bench_gemm(args.repeats)
    models = {}
    if not args.skip_models:
        models[QWEN15] = bench_model(QWEN15, home, args, threads, prefill=True)
        models[SMOL] = bench_model(SMOL, home, args, threads, prefill=False)
    spec = run_spec(args) if args.spec else None

    print(f"\n{cpu_model()}, OMP_NUM_THREADS={threads}, kernels {cpu_kernels.variant()}, flags {' '.join(flags)}")
    if measured_build() is not None:
        print(f"llama.cpp measured: {measured_build()}")
    names = [k for k in gemm[16] if k != "ours"]
    used = cpu_kernels.variant() or "ours"
    head = f"{'M':>4} {used:>12}" + "".join(f" {k:>17}" for k in names) + f" {'ours/onednn':>12}"
    print(f"int8 GEMM on Qwen 1.5B's shapes, GOP/s: {head}")
    for m, r in gemm.items():
        anchor = r.get("onednn int8")
        vs = f"{r['ours'] / anchor:>11.2f}x" if anchor else f"{'-':>12}"
        print(f"{'':40}{m:>4} {r['ours']:>12,.0f}" + "".join(f" {r[k]:>17,.0f}" for k in names) + f" {vs}")
    for name, res in models.items():
        for point, rates in res.items():
            row = ", ".join(f"{k} {v:,.1f}" for k, v in rates.items())
            print(f"{name} {point} tok/s: {row}")
    summary: dict = {
        "cpu": cpu_model(),
        "threads": threads,
        "kernels": cpu_kernels.variant(),
        "flags": flags,
        "gemm_gops": {m: {k: round(v) for k, v in r.items()} for m, r in gemm.items()},
        "gemm_vs_int_mm_m16": round(gemm[16]["ours"] / gemm[16]["_int_mm"], 2),
        "gemm_vs_int_mm_m64": round(gemm[64]["ours"] / gemm[64]["_int_mm"], 2),
        "gemm_vs_int_mm_m512": round(gemm[512]["ours"] / gemm[512]["_int_mm"], 2),
        "gemm_vs_onednn_int8_m64": ratio(gemm[64]["ours"], gemm[64].get("onednn int8")),
        "gemm_vs_onednn_int8_m512": ratio(gemm[512]["ours"], gemm[512].get("onednn int8")),
        "amx_prefill_speedup": None,
        "amx_b16_speedup": None,
        "int4_vs_int8_b16": None,
        "llamacpp_build": measured_build(),
    }
    if models:
        q, s = models[QWEN15], models[SMOL]
        for key, point in (
            ("prefill_vs_llamacpp", q["prefill"]),
            ("b1_vs_llamacpp_qwen15", q["decode_b1"]),
            ("b16_vs_llamacpp_qwen15", q["decode_b16"]),
            ("b1_vs_llamacpp_smollm2", s["decode_b1"]),
        ):
            fmt, _, vs_llama = best(point)
            summary[key] = vs_llama
            summary[f"{key}_format"] = fmt
        summary["prefill_int8_vs_llamacpp"] = (
            round(q["prefill"]["int8"] / q["prefill"]["llama.cpp"], 2) if ("llama.cpp" in q["prefill"]) else None
        )
        summary["int4_vs_int8_b16"] = ratio(q["decode_b16"]["int4"], q["decode_b16"]["int8"])
        if "int8 vnni" in q["prefill"]:
            summary["amx_prefill_speedup"] = ratio(q["prefill"]["int8"], q["prefill"]["int8 vnni"])
            summary["amx_b16_speedup"] = ratio(q["decode_b16"]["int8"], q["decode_b16"]["int8 vnni"])
        summary["tok_s"] = {
            n: {p: {k: round(v, 1) for k, v in r.items()} for p, r in res.items()} for n, res in models.items()
        }
    if spec is not None:
        summary["spec_speedup_b1"] = spec.get("speedup_draft_b1")
        summary["spec"] = spec
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
