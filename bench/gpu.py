"""Decode and prefill throughput per tier on a CUDA device, with and without CUDA graphs and Triton kernels.

    OMP_NUM_THREADS=4 .venv/bin/python -m bench.gpu [--batches 1 16 64] [--decode-tokens 128]
    OMP_NUM_THREADS=4 python -m bench.gpu --shape-dir DIR [DIR ...] --weights bf16 int8 [--configs ...]

Per in-process tier (its checkpoint as configured, loaded onto the GPU) and configuration — `torch`
(the torch reference backend, eager), `triton` (Triton kernels, eager) and `triton+graphs` (Triton
kernels, decode steps replayed from CUDA graphs) — it times decode steps of `batch` sequences (prompts of
32 tokens, `--decode-tokens` greedy tokens each, prefill excluded) and the prefill of 8 prompts of 512
tokens; median of 3 runs after an untimed one. The table, then one JSON line per tier and weight format.

`--shape-dir` measures models given as directories holding only a `config.json` and the tokenizer (a GPU
machine that cannot fetch the registry's weights): each gets random bf16 weights of its shape on the GPU.
`--random-shape` builds one of `bench.random_model.SHAPES` in place on the GPU (Qwen3-30B-A3B, 61 GB in bf16,
and the dense model of its active parameters), Triton + graphs only, and adds each batch's share of the
memory-bandwidth limit: weight bytes a step reads (attention, head, the experts its tokens choose, expected
under uniform routing) × steps/s over the card's peak bandwidth (`PEAK_BANDWIDTH`).
Speed does not depend on the weights' values (every run ignores EOS and generates its full length), so
these are the real architectures' speeds. On a machine without CUDA it says so and exits 0: the kernels
are proven on the CPU by the interpreter tests instead (tests/engines/kernels/test_triton_*).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.common import say

CONFIGS = ("torch", "triton", "triton+graphs")
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s, the vendor's HBM figures (SXM)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--shape-dir", type=Path, nargs="+", help="config.json + tokenizer only: random weights")
    ap.add_argument("--weights", nargs="+", choices=["bf16", "int8", "int4"], help="default: each tier's own")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--runs", type=int, default=3, help="the median of this many runs per number")
    ap.add_argument("--random-shape", nargs="+", default=[], help="bench.random_model.SHAPES, built on the GPU")
    ap.add_argument("--layers", type=int, help="--random-shape: this many layers (default: the model's)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device on this machine; nothing to measure (see tests/test_triton_*)")
        return 0
    say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.random_shape:
        for name in args.random_shape:
            print(json.dumps(random_shape(name, args)), flush=True)
        if not args.shape_dir:
            return 0
    rows = []
    for name, model_dir, dtype, weights in models(args):
        for fmt in args.weights or [weights]:
            result: dict[str, object] = {"tier": name, "weights": fmt, "device": torch.cuda.get_device_name()}
            for config in args.configs:
                started = time.perf_counter()
                engine = load(model_dir, dtype, fmt, config)
                result[f"{config}_load_s"] = round(time.perf_counter() - started, 1)
                for batch in args.batches:
                    tok_s = median(lambda e=engine, b=batch: decode(e, b, args), args.runs)
                    result[f"{config}_decode_b{batch}"] = round(tok_s, 1)
                result[f"{config}_prefill"] = round(median(lambda e=engine: prefill(e), args.runs), 1)
                say(f"{name} {fmt} {config}: {json.dumps(result)}")
                del engine
                torch.cuda.empty_cache()
            rows.append(result)
    keys = [k for k in rows[0] if k.endswith(("_prefill", *(f"_b{b}" for b in args.batches)))] if rows else []
    print("| tier | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys))
    for r in rows:
        print(f"| {r['tier']} {r['weights']} | " + " | ".join(str(r[k]) for k in keys) + " |")
    for r in rows:
        print(json.dumps(r))
    return 0


def models(args: argparse.Namespace) -> list[tuple[str, Path, str, str]]:
    """(name, directory, dtype, weight format) per model to measure: the given shapes, else the in-process
    tiers (a registry tier's directory holds its quantized checkpoint, which loads when the formats match)."""
    if args.shape_dir:
        return [(d.name, random_weights(d), "bf16", "bf16") for d in args.shape_dir]
    from core.settings import Settings

    settings = Settings()
    return [(n, settings.model_dir(t), t.dtype, t.weights) for n, t in settings.tiers.items() if not t.is_remote]


def random_shape(name: str, args: argparse.Namespace) -> dict[str, object]:
    """Decode tok/s per batch of a `bench.random_model` shape built on the GPU (Triton + graphs), and each
    batch's fraction of the bandwidth limit."""
    import torch

    from bench.random_model import random_engine, shape_config, step_bytes

    started = time.perf_counter()
    cfg_dict = shape_config(name, args.layers)
    engine = random_engine(cfg_dict, "cuda", kv_cache_bytes=8 << 30, max_num_seqs=128, cuda_graphs=True)
    cfg = engine.model.config  # type: ignore[attr-defined]
    device = torch.cuda.get_device_name()
    peak = next((bw for key, bw in PEAK_BANDWIDTH.items() if key in device), float("nan"))
    result: dict[str, object] = {
        "shape": name, "layers": cfg.num_hidden_layers, "device": device,
        "weights_gb": round(sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 1e9, 1),  # type: ignore[attr-defined]
        "build_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    say(f"{name}: built {result}")
    for batch in args.batches:
        tok_s = median(lambda e=engine, b=batch: decode(e, b, args), args.runs)
        result[f"decode_b{batch}"] = round(tok_s, 1)
        result[f"bandwidth_fraction_b{batch}"] = round(tok_s / batch * step_bytes(cfg, batch) / peak, 3)
        say(f"{name} batch {batch}: {tok_s:.1f} tok/s")
    del engine
    torch.cuda.empty_cache()
    return result


def random_weights(shape_dir: Path) -> Path:
    """A copy of `shape_dir` (config.json, tokenizer) with random bf16 weights of its shape, built on the GPU."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(tempfile.mkdtemp(prefix=f"{shape_dir.name}-"))
    for f in shape_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")):
            shutil.copy(f, out / f.name)
    config = AutoConfig.from_pretrained(shape_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def load(model_dir: Path, dtype: str, weights: str, config: str) -> object:
    from engines.engine import Engine, EngineConfig
    from engines.kernels.backends import TorchBackend, use

    use("cuda", TorchBackend() if config == "torch" else None)  # before loading: linear layers pick kernels then
    try:
        cfg = EngineConfig(kv_cache_bytes=8 << 30, max_num_seqs=128, cuda_graphs=config.endswith("graphs"))
        return Engine.from_dir(
            model_dir, dtype=dtype, config=cfg, weights=None if weights == "bf16" else weights, device="cuda"
        )
    finally:
        use("cuda", None)


def median(run: object, runs: int) -> float:
    """The median of `runs` timed runs after one untimed run: the first call of a shape JIT-compiles Triton
    kernels (seconds), which a median of 2 would average in (SmolLM2 prefill read 78k tok/s for ~130k warm)."""
    run()  # type: ignore[operator]
    return statistics.median(run() for _ in range(runs))  # type: ignore[operator]


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
