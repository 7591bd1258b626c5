"""The attention layer: grouped-query self-attention over the paged KV cache, behind a backend.

q, k and v come from one fused projection (the weights are read once per step), RoPE rotates q and k on
the device's backend, and the attention itself is the step's `AttentionBackend`
(`engines.kernels.metadata`): the torch reference, our CPU library or Triton, all reading one
`AttentionMetadata` built per step, so the model never asks which.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.kernels.metadata import AttentionBackend, AttentionMetadata
from engines.layers.blocks import rotate
from engines.layers.linear import Linear


class SelfAttention(nn.Module):
    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int, *, bias: bool
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v fused into one matmul: the weights are read once per step.
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, hidden_size)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rotate(q, k, rope, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = backend.forward(self.layer_idx, q, k, v, meta)
        return self.o_proj(out.reshape(n, self.q_size))
