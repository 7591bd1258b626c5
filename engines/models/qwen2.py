"""Qwen2 (Qwen2.5 and Qwen2.5-Coder): the Llama decoder with biases on the q, k and v projections; Qwen2-MoE
the same with sparse MoE MLPs (`engines.models.moe`).

`ModelConfig` switches the bias on for this architecture; sliding-window attention is off in every
Qwen2.5 checkpoint we serve, so `ModelConfig` refuses configs that turn it on.
"""

from __future__ import annotations

from engines.models.config import ModelConfig
from engines.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        if not cfg.attention_bias:
            raise ValueError("Qwen2 checkpoints carry q/k/v biases; the config says otherwise")
        super().__init__(cfg)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE: Qwen2 attention (q/k/v biases) with sparse MoE MLPs."""
