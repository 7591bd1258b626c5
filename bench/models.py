"""Every model family against its reference, Gemma 3 270M against llama.cpp, the sparse tier against dense.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.models [--ppl-windows 4] [--moe-layers 6] [--runs 3]

1. Per family (`bench.tiny_models.FAMILY_DEFAULTS`: Llama 3, Mistral, Qwen3, Qwen3 with YaRN, Qwen3-MoE,
   Gemma 3, every structural switch on): the largest |logit difference| from transformers' own class in
   fp32 over a 40-token prompt computed as a prefill, a chunk over cached blocks and decodes (4-token
   blocks), and whether 32 greedy tokens served by the engine equal `generate`'s.
2. Gemma 3 270M from the registry's GGUF (Q4_K_M): our logits (the GGUF dequantized to fp32) against
   transformers loading the same GGUF, over 700 held-out tokens (past the 512-token window); perplexity on
   `--ppl-windows` windows of 1,024 held-out tokens through our engine (bf16) and through llama.cpp
   (llama-cpp-python on the same file, the same windows and token ids).
3. The sparse tier's speed: Qwen3-30B-A3B's layer shapes (128 experts of 768, top-8) at `--moe-layers`
   layers with random weights, against the dense model of its active parameters (`bench.random_model`),
   decode tok/s at batch 1 and 16 (bf16, EOS ignored, prefill not timed), the two interleaved, median of
   `--runs`.

Last line: one JSON object with `families` (name → `max_abs_diff_fp32`, `greedy_match`),
`gemma3_max_abs_diff_vs_transformers_gguf`, `gemma3_ppl_ratio_vs_llamacpp`, `moe_vs_dense_active_b1`,
`moe_vs_dense_active_b16`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import say
from bench.model_checks import llamacpp_nll, logits_in_pieces
from bench.random_model import random_engine, shape_config
from bench.tiny_models import FAMILY_DEFAULTS, tiny_hf_model
from engines.checkpoints.fetch import fetch_model, registry_model
from engines.checkpoints.loader import load_model
from engines.engine import Engine, EngineConfig
from engines.request import EngineRequest
from engines.sampling import SamplingParams

HOME = Path(os.environ.get("SWITCHBOARD_HOME", Path.home() / ".cache" / "switchboard"))
FAMILIES = list(FAMILY_DEFAULTS)


def family_check(name: str) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    path = tiny_hf_model(name, Path(tempfile.mkdtemp(prefix=f"{name}-")))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(1, 320, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    got = logits_in_pieces(load_model(path, "fp32"), ids, [17, 29])
    engine = Engine.from_dir(path, dtype="fp32", config=EngineConfig(block_size=4, kv_cache_bytes=1 << 22))
    prompt = ids[:24].tolist()
    eos = sorted(engine.tokenizer.eos_token_ids)
    engine.add_request(EngineRequest("g", prompt, SamplingParams(max_tokens=32, temperature=0.0)))
    served: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            served += out.new_token_ids
    reference = hf.generate(
        torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=0
    )[0, len(prompt) :].tolist()
    return {
        "max_abs_diff_fp32": float(f"{(got - expected).abs().max().item():.3g}"),
        "greedy_match": served == reference,
    }


def gemma3_vs_transformers(gguf: Path, text_ids: list[int]) -> float:
    """Max |logit difference|, ours (the GGUF dequantized to fp32) vs transformers loading the same GGUF."""
    from transformers import AutoModelForCausalLM

    from engines.checkpoints.gguf_convert import convert_gguf

    ids = torch.tensor(text_ids[:700])
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    del hf
    with tempfile.TemporaryDirectory(prefix="gemma3-fp32-") as tmp:
        convert_gguf(gguf, Path(tmp), dtype=torch.float32, progress=False)
        got = logits_in_pieces(load_model(tmp, "fp32"), ids, [600, 650], block=16)
    return (got - expected).abs().max().item()


def gemma3_perplexity(model_dir: Path, gguf: Path, text_ids: list[int], windows: int) -> dict[str, float]:
    from engines.checkpoints.quality import token_nll

    size = 1024
    cut = [text_ids[i * size : (i + 1) * size] for i in range(windows)]
    engine = Engine.from_dir(model_dir, dtype="bf16", config=EngineConfig(kv_cache_bytes=1 << 28))
    ours = token_nll(engine, [t for w in cut for t in w], window=size, progress=True)
    theirs = llamacpp_nll(gguf, cut)
    ppl_ours, ppl_theirs = math.exp(ours.double().mean().item()), math.exp(statistics.fmean(theirs))
    return {"ppl_ours_bf16": round(ppl_ours, 3), "ppl_llamacpp": round(ppl_theirs, 3), "tokens": len(ours)}


def decode_tok_s(engine: Engine, batch: int, tokens: int = 24) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(EngineRequest(f"d{time.monotonic_ns()}-{i}", list(range(100 + i, 132 + i)), params))
    n, seconds = 0, 0.0
    while engine.has_unfinished():
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        if all(o.completion_tokens > 1 for o in outs):  # decode steps only
            n, seconds = n + sum(len(o.new_token_ids) for o in outs), seconds + elapsed
    return n / seconds


def sparse_speed(layers: int, runs: int) -> dict[str, float]:
    engines = {
        name: random_engine(shape_config(name, layers), kv_cache_bytes=1 << 28)
        for name in ("qwen3-30b-a3b", "qwen3-30b-a3b-dense-active")
    }
    result: dict[str, float] = {}
    for batch in (1, 16):
        speeds: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(runs):  # interleaved: a drift in the machine's speed hits both alike
            for name, engine in engines.items():
                speeds[name].append(decode_tok_s(engine, batch))
        for name, values in speeds.items():
            result[f"{name}_b{batch}"] = round(statistics.median(values), 1)
            say(f"{name} batch {batch}: {values} tok/s")
        result[f"moe_vs_dense_active_b{batch}"] = round(
            result[f"qwen3-30b-a3b_b{batch}"] / result[f"qwen3-30b-a3b-dense-active_b{batch}"], 3
        )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ppl-windows", type=int, default=4, help="1,024-token windows of held-out text")
    ap.add_argument("--moe-layers", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip", nargs="*", default=[], choices=["families", "gemma3", "moe"])
    args = ap.parse_args()
    from engines.kernels.cpu_info import cpu_flags

    say(f"CPU flags: {' '.join(sorted(cpu_flags() & {'avx2', 'avx512f', 'avx512_vnni', 'avx512_bf16', 'amx_int8'}))}")
    say(f"threads: {torch.get_num_threads()}")
    result: dict[str, object] = {}
    if "families" not in args.skip:
        result["families"] = families = {}
        for name in FAMILIES:
            families[name] = family_check(name)
            say(f"{name}: {families[name]}")
    if "gemma3" not in args.skip:
        from transformers import AutoTokenizer

        from grading.datasets import heldout_text

        model_dir = fetch_model("gemma3-270m", HOME)
        gguf = HOME / "gguf" / registry_model("gemma3-270m").gguf_file
        text_ids = AutoTokenizer.from_pretrained(model_dir)(heldout_text(HOME))["input_ids"]
        result["gemma3_max_abs_diff_vs_transformers_gguf"] = float(f"{gemma3_vs_transformers(gguf, text_ids):.3g}")
        say(f"gemma3 vs transformers(GGUF): {result['gemma3_max_abs_diff_vs_transformers_gguf']}")
        ppl = gemma3_perplexity(model_dir, gguf, text_ids, args.ppl_windows)
        result["gemma3_perplexity"] = ppl
        result["gemma3_ppl_ratio_vs_llamacpp"] = round(ppl["ppl_ours_bf16"] / ppl["ppl_llamacpp"], 4)
        say(f"gemma3 perplexity: {ppl}")
    if "moe" not in args.skip:
        speed = sparse_speed(args.moe_layers, args.runs)
        result["sparse_tier"] = speed | {"layers": args.moe_layers}
        result["moe_vs_dense_active_b1"] = speed["moe_vs_dense_active_b1"]
        result["moe_vs_dense_active_b16"] = speed["moe_vs_dense_active_b16"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
