"""Decoder building blocks shared by the Llama and Qwen2 families.

Tensors are flat over tokens: (num_tokens, ...) with no batch dimension, so a later batch of many
sequences is just more rows. Numerics follow HF transformers (norms in fp32, RoPE tables in fp32).
The residual add with its norm, RoPE and SiLU·mul run on the device's backend (`engines.kernels.backends`): fused
calls of our CPU library or Triton kernels where they apply, the torch reference otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.kernels.backends import backend_for
from engines.layers.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_norm(x, None)[0]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(r), r) for r = residual + x (the pre-norm decoder's residual stream; r = x without one).
        The fused path updates `residual` in place."""
        return backend_for(x).add_rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF `rotate_half`).

    cos/sin tables are computed in fp32 like HF, stored in the model dtype (HF casts them to the
    activations' dtype on every call), and looked up once per forward pass for all layers.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)  # (P, head_dim/2)
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for these positions, shaped (tokens, 1, head_dim/2) to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(
    q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q (tokens, q_heads·D) and k (tokens, k_heads·D) → (tokens, heads, D) each. The fused
    path rotates them in place (they are views of the qkv projection's output)."""
    cos, sin = rope
    return backend_for(q).rotate(q, k, cos, sin, head_dim)


class SwiGLU(nn.Module):
    """gate and up projections fused into one matmul: one weight read per step instead of two."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(backend_for(gate_up).silu_mul(gate_up, self.intermediate))
