"""Dense vs split-MoE large tier: active parameters, decode speed, perplexity and GSM8K accuracy.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.moe [--experts 8 --shared 1792 --top-k 2 4]

Builds (once, into the models cache) a MoE of Qwen2.5-Coder-1.5B by splitting each MLP into
--experts experts plus --shared neurons every token runs (`switchboard models moe --method split`,
routers fitted on Python's own docs and stdlib), and serves it with each --top-k (the same weights;
only the config's experts per token differ). All models serve int8 weights, as the large tier does
on this CPU. In one process, same threads:
  decode tok/s at batch 1 and 8 on MT-bench first turns (greedy, EOS ignored, prefill not timed);
  perplexity on held-out text (`engines.checkpoints.quality`, --ppl-tokens tokens) and accuracy on the first
  --gsm8k GSM8K test problems.
Active parameters: the linear weights one token reads (attention, router, shared and chosen
experts, output head; the embedding row is a lookup). Last line: one JSON object, for the smallest
top-k within 5% perplexity of the dense model (else the largest).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.common import mtbench_questions, say
from engines.checkpoints.fetch import fetch_model
from engines.checkpoints.moe_build import build_moe
from engines.checkpoints.quality import perplexity
from engines.checkpoints.quantized import fetch_quantized
from engines.engine import Engine, EngineConfig
from engines.models.config import ModelConfig
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from gateway.runtime.model_quality import gsm8k_accuracy
from grading.datasets import heldout_text, load_gsm8k

MODEL = "qwen2.5-coder-1.5b-instruct"


def decode_tok_s(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"d{i}-{time.monotonic_ns()}", p, params))
    started = 0
    while started < len(prompts):  # prefill: until each sequence has its first token
        started += sum(o.completion_tokens == 1 for o in engine.step())
    t0 = time.perf_counter()
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    return generated / (time.perf_counter() - t0)


def active_params(cfg: ModelConfig) -> int:
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    attn = h * (cfg.num_attention_heads * cfg.head_dim) * 2 + h * (cfg.num_key_value_heads * cfg.head_dim) * 2
    if cfg.num_experts:
        mlp = 3 * h * (cfg.shared_expert_intermediate_size + cfg.num_experts_per_tok * cfg.moe_intermediate_size)
        mlp += h * cfg.num_experts  # the router
    else:
        mlp = 3 * h * cfg.intermediate_size
    return layers * (attn + mlp) + cfg.vocab_size * h


def with_top_k(moe_dir: Path, k: int) -> Path:
    """The split checkpoint served with k experts per token: its config, the same weight files."""
    out = moe_dir.parent / f"{moe_dir.name}-k{k}"
    out.mkdir(exist_ok=True)
    for f in moe_dir.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    config = json.loads((moe_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"num_experts_per_tok": k}, indent=2))
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.moe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--shared", type=int, default=1792, help="neurons every token runs (of 8960)")
    p.add_argument("--top-k", type=int, nargs="+", default=[2, 4], help="experts per token to serve")
    p.add_argument("--calibration-tokens", type=int, default=4096)
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--gsm8k", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens per sequence for speed")
    p.add_argument("--home", type=Path, default=Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")))
    args = p.parse_args()
    home = args.home.expanduser()
    threads = int(os.environ["OMP_NUM_THREADS"])

    dense_dir = fetch_model(MODEL, home)
    moe_dir = home / "models" / f"{MODEL}-moe-e{args.experts}s{args.shared}"
    report = None
    if not (moe_dir / "config.json").is_file():
        say(f"splitting {MODEL} into {args.experts} experts ({args.shared} shared neurons)")
        report = build_moe(
            dense_dir, moe_dir, experts=args.experts, top_k=min(args.top_k), method="split", shared=args.shared,
            calibration_tokens=args.calibration_tokens,
        )  # fmt: skip
    config = EngineConfig(kv_cache_bytes=512 << 20)
    engines = {"dense": Engine.from_dir(fetch_quantized(MODEL, home, "int8"), config=config)}
    for k in args.top_k:
        engines[f"moe k={k}"] = Engine.from_dir(with_top_k(moe_dir, k), config=config, weights="int8")
    tok = engines["dense"].tokenizer
    questions = mtbench_questions(home)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions[:8]]
    for e in engines.values():
        decode_tok_s(e, prompts[:1], 4)  # warm-up
    results: dict[str, dict] = {name: {} for name in engines}
    for name, e in engines.items():
        cfg = e.model.config
        results[name]["active_params"] = active_params(cfg)
        for b in (1, 8):
            say(f"{name}: decode at batch {b}")
            results[name][f"tok_s_b{b}"] = decode_tok_s(e, prompts[:b], args.tokens)
    text_ids = tok.encode(heldout_text(home, progress=False))[: args.ppl_tokens]
    problems = load_gsm8k(home, args.gsm8k, progress=False) if args.gsm8k else []
    for name, e in engines.items():
        say(f"{name}: perplexity and GSM8K")
        results[name]["ppl"] = perplexity(e, text_ids)
        if problems:
            results[name]["gsm8k"] = gsm8k_accuracy(e, problems, max_tokens=256, batch=8)[0]

    d = results["dense"]
    print(
        f"\nQwen2.5-Coder-1.5B int8, dense vs split MoE ({args.experts} experts + {args.shared} shared neurons), "
        f"OMP_NUM_THREADS={threads}"
    )
    if report is not None:
        print(f"router recall (top-{min(args.top_k)}) {report.router_recall:.3f}")
    print(f"{'model':10} {'active params':>14} {'tok/s b1':>9} {'tok/s b8':>9} {'ppl':>8} {'GSM8K':>7}")
    for name, r in results.items():
        print(
            f"{name:10} {r['active_params'] / 1e6:13.0f}M {r['tok_s_b1']:9.2f} {r['tok_s_b8']:9.2f} {r['ppl']:8.4f} "
            f"{r.get('gsm8k', float('nan')):7.3f}"
        )
    moes = [n for n in results if n != "dense"]
    within = [n for n in moes if results[n]["ppl"] <= 1.05 * d["ppl"]]
    pick = within[0] if within else moes[-1]
    m = results[pick]
    summary = {
        "variant": pick,
        "active_param_ratio": round(m["active_params"] / d["active_params"], 4),
        "speedup": round(m["tok_s_b1"] / d["tok_s_b1"], 3),
        "speedup_b8": round(m["tok_s_b8"] / d["tok_s_b8"], 3),
        "ppl_delta_pct": round(100 * (m["ppl"] / d["ppl"] - 1), 2),
        "gsm8k_delta_points": round(100 * (m.get("gsm8k", 0.0) - d.get("gsm8k", 0.0)), 2),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
