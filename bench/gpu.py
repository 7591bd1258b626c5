"""Decode and prefill throughput per tier on a CUDA device, with and without CUDA graphs and Triton kernels.

    OMP_NUM_THREADS=4 .venv/bin/python -m bench.gpu [--batches 1 16 64] [--decode-tokens 128]

Per in-process tier (its checkpoint as configured, loaded onto the GPU) and configuration — `torch`
(the torch reference backend, eager), `triton` (Triton kernels, eager) and `triton+graphs` (Triton
kernels, decode steps replayed from CUDA graphs) — it times decode steps of `batch` sequences (prompts of
32 tokens, `--decode-tokens` greedy tokens each, prefill excluded) and the prefill of 8 prompts of 512
tokens; median of 3 runs. The table, then one JSON line per tier. On a machine without CUDA it says so
and exits 0: the kernels are proven on the CPU by the interpreter tests instead (tests/engines/kernels/test_triton_*).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

from bench.common import say

CONFIGS = ("torch", "triton", "triton+graphs")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--decode-tokens", type=int, default=128)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device on this machine; nothing to measure (see tests/test_triton_*)")
        return 0
    from core.settings import Settings

    settings = Settings()
    rows = []
    for name, tier in settings.tiers.items():
        if tier.is_remote:
            continue
        result: dict[str, object] = {"tier": name, "model": tier.model, "weights": tier.weights}
        for config in CONFIGS:
            engine = load(settings, tier, config)
            for batch in args.batches:
                result[f"{config}_decode_b{batch}"] = round(median(lambda e=engine, b=batch: decode(e, b, args)), 1)
            result[f"{config}_prefill"] = round(median(lambda e=engine: prefill(e)), 1)
            say(f"{name} {config}: done")
            del engine
            torch.cuda.empty_cache()
        rows.append(result)
    keys = [k for k in rows[0] if k.endswith(("_prefill", *(f"_b{b}" for b in args.batches)))] if rows else []
    print("| tier | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys))
    for r in rows:
        print(f"| {r['tier']} | " + " | ".join(str(r[k]) for k in keys) + " |")
    for r in rows:
        print(json.dumps(r))
    return 0


def load(settings: object, tier: object, config: str) -> object:
    from engines.engine import Engine
    from engines.kernels.backends import TorchBackend, use
    from gateway.tiers import engine_config

    use("cuda", TorchBackend() if config == "torch" else None)  # before loading: linear layers pick kernels then
    try:
        cfg = replace(engine_config(tier), cuda_graphs=config.endswith("graphs"))  # type: ignore[arg-type]
        return Engine.from_dir(
            settings.model_dir(tier),
            dtype=tier.dtype,
            config=cfg,
            name=tier.model,
            device="cuda",  # type: ignore[attr-defined]
        )
    finally:
        use("cuda", None)


def median(run: object) -> float:
    return statistics.median(run() for _ in range(3))  # type: ignore[operator]


def decode(engine: object, batch: int, args: argparse.Namespace) -> float:
    """Decode tok/s: `batch` sequences generating together, prefill steps excluded."""
    import torch

    from engines.request import EngineRequest
    from engines.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(EngineRequest(f"d{time.monotonic_ns()}-{i}", list(range(100, 132)), params))  # type: ignore[attr-defined]
    tokens, seconds = 0, 0.0
    while engine.has_unfinished():  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = engine.step()  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if all(o.completion_tokens > 1 for o in outs):  # decode steps only
            tokens, seconds = tokens + sum(len(o.new_token_ids) for o in outs), seconds + elapsed
    return tokens / seconds if seconds else float("nan")


def prefill(engine: object) -> float:
    """Prefill tok/s: 8 prompts of 512 tokens, one token generated each."""
    import torch

    from engines.request import EngineRequest
    from engines.sampling import SamplingParams

    for i in range(8):
        prompt = [100 + (i * 7 + j) % 1000 for j in range(512)]
        engine.add_request(EngineRequest(f"p{time.monotonic_ns()}-{i}", prompt, SamplingParams(max_tokens=1)))  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished():  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    return 8 * 512 / (time.perf_counter() - start)


if __name__ == "__main__":
    sys.exit(main())
