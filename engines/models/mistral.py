"""Mistral: the Llama decoder, every layer attending over a sliding window where the config sets
`sliding_window` (Mistral 7B v0.1: 4096; v0.2 on: none)."""

from __future__ import annotations

from engines.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with `ModelConfig.windows` from `sliding_window`."""
