"""The decoders, keyed by the `architectures` name in a Hugging Face config: Llama 2/3 (`llama`), Mistral
(`mistral`), Qwen2 and Qwen2-MoE (`qwen2`), Qwen3 and Qwen3-MoE (`qwen3`), Mixtral (`mixtral`), Gemma 3 text
(`gemma3`), their sparse MoE MLP (`moe`) and the subset of `config.json` they read (`config`). Built from
`engines.layers`; `engines.checkpoints.loader` fills their weights.
"""

from __future__ import annotations

from torch import nn

from engines.models.config import ModelConfig, MoEConfig, UnsupportedModelError
from engines.models.gemma3 import Gemma3ForCausalLM
from engines.models.llama import LlamaForCausalLM
from engines.models.mistral import MistralForCausalLM
from engines.models.mixtral import MixtralForCausalLM
from engines.models.moe import SparseMoE
from engines.models.qwen2 import Qwen2ForCausalLM, Qwen2MoeForCausalLM
from engines.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM

__all__ = [
    "MODEL_CLASSES",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "MoEConfig",
    "ModelConfig",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "SparseMoE",
    "UnsupportedModelError",
    "build_model",
]

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def build_model(cfg: ModelConfig) -> nn.Module:
    return MODEL_CLASSES[cfg.architecture](cfg)
