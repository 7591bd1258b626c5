"""Mixtral: the Llama decoder with sparse MoE MLPs (`engines.models.moe`)."""

from __future__ import annotations

from engines.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Llama attention with sparse MoE MLPs (no shared expert)."""
