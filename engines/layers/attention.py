"""The attention layer: grouped-query self-attention over the paged KV cache, behind a backend.

q, k and v come from one fused projection (the weights are read once per step); Qwen3 and Gemma 3 norm each
q and k head (`q_norm`, `k_norm`); RoPE rotates q and k on the device's backend, and the attention itself is
the step's `AttentionBackend` (`engines.kernels.metadata`): the torch reference, our CPU library or Triton,
all reading one `AttentionMetadata` built per step, so the model never asks which. A sliding-window layer passes its
window (a query sees itself and the `window - 1` positions before it), and a model with its own score scale
(Gemma 3's `query_pre_attn_scalar`) that scale.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.kernels.metadata import AttentionBackend, AttentionMetadata
from engines.layers.blocks import RMSNorm, rotate
from engines.layers.linear import Linear


class SelfAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        *,
        bias: bool,
        qk_norm: RMSNorm | None = None,
        window: int = 0,
        scale: float | None = None,
    ) -> None:
        """`qk_norm`: a norm of size head_dim to copy for q and for k (None: no q/k norm)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.window = window
        self.scale = scale
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v fused into one matmul: the weights are read once per step.
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, hidden_size)
        if qk_norm is not None:
            self.q_norm: RMSNorm | None = qk_norm
            self.k_norm: RMSNorm | None = type(qk_norm)(head_dim, qk_norm.eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            d = self.head_dim
            q = self.q_norm(q.reshape(-1, d)).view(n, self.q_size)
            k = self.k_norm(k.reshape(-1, d)).view(n, self.kv_size)
        q, k = rotate(q, k, rope, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = backend.forward(self.layer_idx, q, k, v, meta, window=self.window, scale=self.scale)
        return self.o_proj(out.reshape(n, self.q_size))
