"""The decoder's building blocks, above the kernels and below the models: linear layers that pick their kernel
once the weights are in (`linear`: prepacked bf16, int8, int4), the attention layer over the paged KV cache
(`attention`), and RMSNorm, RoPE and SwiGLU (`blocks`). Their hot ops run on the device's backend
(`engines.kernels.backends`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines import lazy_exports

if TYPE_CHECKING:
    from engines.layers.attention import SelfAttention
    from engines.layers.blocks import RMSNorm, RotaryEmbedding, SwiGLU, rotate
    from engines.layers.linear import BackendKernel, Embedding, Int4Kernel, Int8Kernel, Linear

__all__ = [
    "BackendKernel",
    "Embedding",
    "Int4Kernel",
    "Int8Kernel",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "SwiGLU",
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
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
