"""Tiny random-weight models of our architectures, with a word-level tokenizer: fast engine tests.

Words `w1`..`w319` are token ids 1..319 and `<eos>` is 0, so a test can write prompts as id lists.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320


def tiny_hf_model(arch: str, path: Path, **overrides: object) -> Path:
    """Save a random HF Llama, Qwen2, Qwen2-MoE or Mixtral model (and a tokenizer) to `path`."""
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
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
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
    cfg.update(overrides)
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
