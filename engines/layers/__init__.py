"""The decoder's building blocks, above the kernels and below the models: linear layers that pick their kernel
once the weights are in (`linear`: prepacked bf16, int8, int4), the attention layer over the paged KV cache
(`attention`), RMSNorm, RoPE and SwiGLU (`blocks`), and LoRA deltas on a mixed batch's rows (`lora`). Their hot
ops run on the device's backend (`engines.kernels.backends`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines import lazy_exports

if TYPE_CHECKING:
    from engines.layers.attention import SelfAttention
    from engines.layers.blocks import RMSNorm, RotaryEmbedding, SwiGLU, rotate
    from engines.layers.linear import BackendKernel, Embedding, Int4Kernel, Int8Kernel, Linear
    from engines.layers.lora import LoraBatch, LoraWeights, lora_batch

__all__ = [
    "BackendKernel",
    "Embedding",
    "Int4Kernel",
    "Int8Kernel",
    "Linear",
    "LoraBatch",
    "LoraWeights",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "SwiGLU",
    "lora_batch",
    "rotate",
]

_EXPORTS = {
    "SelfAttention": "attention",
    "RMSNorm": "blocks",
    "RotaryEmbedding": "blocks",
    "SwiGLU": "blocks",
    "rotate": "blocks",
    "BackendKernel": "linear",
    "Embedding": "linear",
    "Int4Kernel": "linear",
    "Int8Kernel": "linear",
    "Linear": "linear",
    "LoraBatch": "lora",
    "LoraWeights": "lora",
    "lora_batch": "lora",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
