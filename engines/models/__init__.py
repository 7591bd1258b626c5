"""Decoder implementations, keyed by the `architectures` name in a Hugging Face config."""

from __future__ import annotations

from torch import nn

from engines.models.config import ModelConfig
from engines.models.llama import LlamaForCausalLM
from engines.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM
from engines.models.qwen2 import Qwen2ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def build_model(cfg: ModelConfig) -> nn.Module:
    return MODEL_CLASSES[cfg.architecture](cfg)
