"""Decoder building blocks shared by every family: RMSNorm (and Gemma's `1 + weight` form), RoPE under any
supported scaling (`engines.layers.rope_scaling`), and the gated MLP (SiLU: SwiGLU; GELU-tanh: GeGLU).

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
from engines.layers.rope_scaling import RopeScaling


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


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w and the norm scales by (1 + w), in fp32 before the cast
    back (HF's `Gemma3RMSNorm`). Fused on the GPU (Triton: six norms a layer, ~7 torch kernels each
    unfused); the torch form on the CPU."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        torch.nn.init.zeros_(self.weight)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return backend_for(x).add_rms_norm(x, self.weight, self.eps, residual, offset=True)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF `rotate_half`).

    cos/sin tables are computed in fp32 like HF (scaled by the rope type's attention factor), stored in
    the model dtype (HF casts them to the activations' dtype on every call), and looked up once per
    forward pass for all layers.
    """

    def __init__(self, head_dim: int, scaling: RopeScaling | float, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.scaling = scaling if isinstance(scaling, RopeScaling) else RopeScaling(theta=float(scaling))
        self.theta = self.scaling.theta
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        inv_freq, factor = self.scaling.frequencies(self.head_dim)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)  # (P, head_dim/2)
        cos, sin = freqs.cos(), freqs.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin = sin.to(device=device, dtype=dtype)

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


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class SwiGLU(nn.Module):
    """The gated MLP, down(act(gate) · up), with gate and up fused into one matmul: one weight read per step
    instead of two. act is SiLU (SwiGLU: Llama, Qwen, Mistral) or GELU-tanh (GeGLU: Gemma 3)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not one of {ACTIVATIONS}")
        self.intermediate = intermediate
        self.act = act
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "silu":
            return self.down_proj(backend_for(gate_up).silu_mul(gate_up, self.intermediate))
        return self.down_proj(backend_for(gate_up).gelu_tanh_mul(gate_up, self.intermediate))
