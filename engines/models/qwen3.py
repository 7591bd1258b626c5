"""Qwen3 and Qwen3-MoE: the Llama decoder with an RMSNorm over each q and k head before RoPE and no q/k/v
biases; Qwen3-MoE's sparse layers are `engines.models.moe.SparseMoE` with many experts, top-k renormalised
by `norm_topk_prob` and no shared expert, dense where `mlp_only_layers` / `decoder_sparse_step` say.
Sliding windows only where a config turns `use_sliding_window` on (none of the released ones do)."""

from __future__ import annotations

from engines.models.config import ModelConfig
from engines.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        if not cfg.qk_norm:
            raise ValueError("Qwen3 norms q and k per head; the config says otherwise")
        super().__init__(cfg)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3 attention with sparse MoE MLPs."""
