"""The decoders, keyed by the `architectures` name in a Hugging Face config: Llama (`llama`), Qwen2 and
Qwen2-MoE (`qwen2`), Mixtral (`mixtral`), their sparse MoE MLP (`moe`) and the subset of `config.json` they
read (`config`). Built from `engines.layers`; `engines.checkpoints.loader` fills their weights.
"""

from __future__ import annotations

from torch import nn

from engines.models.config import ModelConfig, MoEConfig, UnsupportedModelError
from engines.models.llama import LlamaForCausalLM
from engines.models.mixtral import MixtralForCausalLM
from engines.models.moe import SparseMoE
from engines.models.qwen2 import Qwen2ForCausalLM, Qwen2MoeForCausalLM

__all__ = [
    "MODEL_CLASSES",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "MoEConfig",
    "ModelConfig",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "SparseMoE",
    "UnsupportedModelError",
    "build_model",
]

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def build_model(cfg: ModelConfig) -> nn.Module:
    return MODEL_CLASSES[cfg.architecture](cfg)
