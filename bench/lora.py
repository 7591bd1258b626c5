"""Multi-LoRA decode: steps that mix sequences of several adapters and of the bare base, against the base alone.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.lora [--model qwen2.5-coder-0.5b-instruct] [--weights int8]

Adapters: `--adapters` (8) random rank-16 PEFT adapters on every projection of the small tier's checkpoint (made
with `peft` and saved in its format, then loaded by `Engine.load_adapter`). For 1, 8 and 16 sequences (64-token
prompts) spread round-robin over 0 (the bare base), 1, 4 and 8 adapters, the median decode step time over
`--steps` steps once every sequence decodes, all in one engine in one run. Checks: each sequence's greedy tokens
in the mixed batch equal those of its adapter served alone; and, on the float checkpoint (fp32), one adapter's
logits against transformers + PEFT on the same files (the largest difference).

The last line is one JSON object: `step_ms` (sequences → adapters → ms), `mixed_vs_base_step_ratio_16` (16
sequences over 8 adapters against 16 on the base; target ≤ 1.3), `alone_equal`, `peft_max_abs_diff`,
`adapter_mb`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import THREADS, say
from engines.engine import Engine
from engines.lora.adapter import PROJECTIONS
from engines.request import EngineRequest
from engines.sampling import SamplingParams

PROMPT_TOKENS = 64
RANK = 16


def make_adapters(model_dir: Path, out: Path, n: int) -> list[Path]:
    """`n` random PEFT adapters (rank 16, every projection), saved once under `out`."""
    import peft
    from transformers import AutoModelForCausalLM

    paths = [out / f"adapter-{i}" for i in range(n)]
    if all((p / "adapter_model.safetensors").exists() for p in paths):
        return paths
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, path in enumerate(paths):
        torch.manual_seed(i)
        config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(PROJECTIONS), init_lora_weights=False)
        model = peft.get_peft_model(base, config)
        with torch.no_grad():  # PEFT's random B moves the logits by tens; a trained adapter's delta is small
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.01)
        model.save_pretrained(path)
        base = model.unload()  # the base again, without this adapter's layers
    return paths


def prompts(n: int, vocab: int) -> list[list[int]]:
    """`n` distinct prompts of PROMPT_TOKENS ids (away from the lowest ids, where special tokens live)."""
    return [[(17 * i + 31 * j) % (vocab - 200) + 100 for j in range(PROMPT_TOKENS)] for i in range(n)]


def step_ms(engine: Engine, seqs: int, adapters: int, steps: int) -> tuple[float, dict[str, list[int]]]:
    """Median decode step (ms) with `seqs` sequences over `adapters` adapters (0: the base), and their tokens."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    names = [f"a{i % adapters}" if adapters else None for i in range(seqs)]
    for i, (prompt, name) in enumerate(zip(prompts(seqs, engine.model.config.vocab_size), names, strict=True)):
        engine.add_request(EngineRequest(f"s{i}", prompt, params, adapter=name, cache_salt=f"{i}-{name}"))
    tokens: dict[str, list[int]] = {f"s{i}": [] for i in range(seqs)}
    times = []
    while engine.has_unfinished():
        decoding = all(s.num_computed >= len(s.request.prompt_token_ids) for s in engine._seqs.values())
        started = time.perf_counter()
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if decoding and len(engine._seqs) == seqs:
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times[:steps]), tokens


def peft_diff(model_dir: Path, adapter: Path) -> float:
    """Largest |logit| difference, ours (fp32, float weights) against transformers + PEFT (fp32), one prompt."""
    import peft
    from transformers import AutoModelForCausalLM

    from engines.checkpoints.loader import load_model
    from engines.kernels.metadata import AttentionMetadata
    from engines.kernels.reference import TorchPagedAttention
    from engines.kv.cache import PagedKVCache
    from engines.layers.lora import LoraBatch, lora_batch
    from engines.lora import Adapters

    ours = load_model(model_dir, "fp32")
    ids = torch.tensor(prompts(1, ours.config.vocab_size)[0])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = peft.PeftModel.from_pretrained(hf, adapter).eval()(ids[None]).logits[0].float()
    Adapters(ours).load("a", adapter)
    cfg = ours.config
    blocks = -(-len(ids) // 16)
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, blocks, 16, ours.dtype)
    cache.zero_blocks(list(range(blocks)))
    meta = AttentionMetadata.build(16, [list(range(blocks))], [0], [len(ids)])
    with torch.no_grad(), lora_batch(LoraBatch.every_row("a", len(ids))):
        got = ours.compute_logits(ours(ids, torch.arange(len(ids)), TorchPagedAttention(cache), meta))
    return float((got - expected).abs().max())


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--weights", default="int8", choices=["int8", "int4", "bf16"])
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--home", type=Path, default=Path("~/.cache/switchboard").expanduser())
    ap.add_argument("--out", type=Path, default=Path("bench/results/lora"))
    args = ap.parse_args()
    model_dir = args.home / "models" / args.model
    paths = make_adapters(model_dir, args.out, args.adapters)
    weights = None if args.weights == "bf16" else args.weights
    engine = Engine.from_dir(model_dir, dtype="bf16", weights=weights)
    for i, path in enumerate(paths):
        engine.load_adapter(f"a{i}", path)
    say(f"{args.model} {args.weights}, {len(paths)} adapters of rank {RANK}, {THREADS} threads")
    table: dict[int, dict[int, float]] = {}
    mixed: dict[str, list[int]] = {}
    for seqs in (1, 8, 16):
        for adapters in (0, 1, 4, 8):
            ms, tokens = step_ms(engine, seqs, min(adapters, len(paths)), args.steps)
            table.setdefault(seqs, {})[adapters] = round(ms, 2)
            say(f"  {seqs:>2} sequences, {adapters} adapters: {ms:.1f} ms a step")
            if seqs == 16 and adapters == 8:
                mixed = tokens
    alone = _alone_equal(engine, mixed, args.steps)
    diff = peft_diff(model_dir, paths[0])
    adapter_mb = engine.adapters.use("a0").nbytes / 1e6  # type: ignore[union-attr]
    summary = {
        "model": args.model, "weights": args.weights, "threads": THREADS, "rank": RANK, "step_ms": table,
        "mixed_vs_base_step_ratio_16": round(table[16][8] / table[16][0], 3), "alone_equal": alone,
        "peft_max_abs_diff": round(diff, 4), "adapter_mb": round(adapter_mb, 1),
    }  # fmt: skip
    print(json.dumps(summary))
    return 0


def _alone_equal(engine: Engine, mixed: dict[str, list[int]], steps: int) -> bool:
    """Each of the mixed batch's first 8 sequences served alone, under its adapter, gives the same tokens."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts(8, engine.model.config.vocab_size)):
        engine.add_request(EngineRequest("alone", prompt, params, adapter=f"a{i % 8}", cache_salt=f"alone-{i}"))
        got: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                got += out.new_token_ids
        if got != mixed[f"s{i}"]:
            say(f"  sequence {i} alone differs from the mixed batch")
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
