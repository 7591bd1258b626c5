"""Tiny random-weight models of every family we serve, with a word-level tokenizer: the engine tests' models
(`tests/tiny.py` re-exports them) and `bench.models`' per-family comparison with transformers.

Words `w1`..`w319` are token ids 1..319 and `<eos>` is 0, so a test can write prompts as id lists.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320


# Every structural switch of each family on, at sizes the suite can afford: windows shorter than the tests'
# prompts, Llama 3's frequency scaling at an original length the prompts pass, dense and sparse layers mixed.
FAMILY_DEFAULTS: dict[str, dict] = {
    "llama3": dict(
        rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
        tie_word_embeddings=True,
        eos_token_id=[0, 318, 319],
    ),
    "mistral": dict(sliding_window=12, head_dim=16),
    "qwen3": dict(head_dim=32, tie_word_embeddings=True),
    "qwen3_yarn": dict(
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        max_position_embeddings=256,
    ),
    "qwen3_moe": dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], head_dim=16,
    ),
    "gemma3": dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=10, layer_types=[
            "sliding_attention", "sliding_attention", "full_attention",
        ], rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        }, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
    ),
}  # fmt: skip


def tiny_hf_model(arch: str, path: Path, **overrides: object) -> Path:
    """Save a random HF model of a family (llama, llama3, mistral, qwen2, qwen2_moe, qwen3, qwen3_yarn,
    qwen3_moe, mixtral, gemma3) and a word tokenizer to `path`."""
    import transformers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "llama3": (LlamaConfig, LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_yarn": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    moe = {
        "qwen2_moe": dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96
        ),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    }.get(arch, {})
    cfg = moe | dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        eos_token_id=0,
    )
    cfg.update(FAMILY_DEFAULTS.get(arch, {}))
    cfg.update(overrides)
    if "layer_types" in cfg and len(cfg["layer_types"]) != cfg["num_hidden_layers"]:  # every third layer global
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(cfg["num_hidden_layers"])
        ]
    torch.manual_seed(0)
    model = model_cls(config_cls(**cfg)).eval()
    model.save_pretrained(path)
    _save_word_tokenizer(path)
    return path


def _save_word_tokenizer(path: Path) -> None:
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {"<eos>": 0} | {f"w{i}": i for i in range(1, VOCAB)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<eos>", "tokenizer_class": "PreTrainedTokenizerFast"})
    )
