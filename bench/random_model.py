"""Engines of a real model's shape with random weights, built in place on their device: speed does not depend on
the weights' values, and a 30B MoE never has to be written to disk and read back (61 GB in bf16).

`SHAPES` holds the shapes the benchmarks use: Qwen3-30B-A3B (48 layers, 128 experts of 768, top-8,
hidden 2048, 32 query / 4 KV heads of 128) and the dense model of its active parameters (the same layers
with one MLP of 8 × 768 = 6,144: what a token computes in the MoE, minus the router). `random_engine` builds
either with any layer count; the experts of each sparse layer are views into one stacked tensor per
projection (the fused MoE kernel's layout: no second copy on the GPU), and a word-level tokenizer of the
model's vocabulary stands in for the real one (ids in, ids out).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from engines.engine import Engine, EngineConfig
from engines.models.config import ModelConfig

QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    # the same attention and layers; one dense MLP as wide as the 8 chosen experts together
    "qwen3-30b-a3b-dense-active": QWEN3_30B_A3B | {"architectures": ["Qwen3ForCausalLM"], "intermediate_size": 8 * 768},
}


def shape_config(name: str, layers: int | None = None) -> dict[str, Any]:
    cfg = dict(SHAPES[name])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def active_params(cfg: ModelConfig) -> int:
    """Linear weights one decode token reads: attention, router and chosen experts (or the dense MLP), head."""
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    total = cfg.vocab_size * cfg.hidden_size
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_sparse_layer(layer):
            mlp = (
                cfg.num_experts * cfg.hidden_size
                + cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
            )
        else:
            mlp = 3 * cfg.hidden_size * cfg.intermediate_size
        total += attn + mlp
    return total


def expected_experts(cfg: ModelConfig, batch: int) -> float:
    """Distinct experts a layer reads for `batch` tokens under uniform routing: E (1 - (1 - k/E)^B)."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def step_bytes(cfg: ModelConfig, batch: int, bytes_per_param: int = 2) -> float:
    """Weight bytes one decode step of `batch` tokens reads (KV excluded): the memory-bandwidth floor."""
    total = active_params(cfg)
    if cfg.num_experts:
        chosen = cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        sparse = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
        total += sparse * (expected_experts(cfg, batch) * per_expert - chosen)
    return total * bytes_per_param


def word_tokenizer_dir(vocab: int, path: Path) -> Path:
    """A word-level tokenizer of `vocab` ids (`w0`, `w1`, ...) saved to `path`: decode works for every id."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "w0", "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    return path


@torch.inference_mode()
def random_model(cfg_dict: dict[str, Any], device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> Any:
    """Our model of this config with N(0, 0.02) weights (norms 1), built on `device`."""
    from engines.models import build_model
    from engines.models.moe import SparseMoE

    cfg = ModelConfig.from_dict(cfg_dict)
    with torch.device("meta"):
        model = build_model(cfg)
    for module in model.modules():
        if isinstance(module, SparseMoE):  # no per-expert storage: the stacked tensors below hold it
            for expert in module.experts:
                expert.gate_up_proj.weight = expert.down_proj.weight = None
    model = model.to_empty(device=device).to(dtype).eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if p is None:
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    for module in model.modules():
        if isinstance(module, SparseMoE):
            gate_up = torch.empty(cfg.num_experts, 2 * inter, hidden, device=device, dtype=dtype).normal_(
                0, 0.02, generator=gen
            )
            down = torch.empty(cfg.num_experts, hidden, inter, device=device, dtype=dtype).normal_(
                0, 0.02, generator=gen
            )
            for e, expert in enumerate(module.experts):
                expert.gate_up_proj.weight = torch.nn.Parameter(gate_up[e], requires_grad=False)
                expert.down_proj.weight = torch.nn.Parameter(down[e], requires_grad=False)
            module._triton_stacked = (gate_up, down)  # the fused MoE kernel's layout, already there
    model.prepare()
    return model


def random_engine(
    cfg_dict: dict[str, Any], device: str = "cpu", dtype: torch.dtype = torch.bfloat16, **config: Any
) -> Engine:
    from engines.tokenizer import Tokenizer

    model = random_model(cfg_dict, device, dtype)
    tok_dir = word_tokenizer_dir(cfg_dict["vocab_size"], Path(tempfile.mkdtemp(prefix="words-")))
    return Engine(model, Tokenizer(tok_dir), EngineConfig(**config))
