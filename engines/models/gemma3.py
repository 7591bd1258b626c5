"""Gemma 3 (text): the Llama decoder with every Gemma switch of `ModelConfig` on. Embeddings times √hidden;
RMSNorms scale by (1 + w); the attention output and the MLP output each normed before their residual add,
the MLP input by a norm of its own; GELU-tanh gating; q/k norms; five sliding-window layers (local RoPE,
θ = 10,000) to each global one (θ = 1,000,000, linearly scaled in the 4B+ models); scores scaled by
`query_pre_attn_scalar`^-0.5; logits soft-capped where `final_logit_softcapping` is set."""

from __future__ import annotations

from engines.models.config import ModelConfig
from engines.models.llama import LlamaForCausalLM


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        if not (cfg.gemma_norms and cfg.qk_norm):
            raise ValueError("a Gemma 3 config must switch on Gemma's norms and q/k norms")
        super().__init__(cfg)
