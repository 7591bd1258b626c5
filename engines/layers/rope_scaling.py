"""RoPE's inverse frequencies under the scalings checkpoints ship with, as Hugging Face computes them.

`rope_type` (a config's `rope_parameters` / `rope_scaling`):
- `default`: θ^(-2i/d).
- `linear`: every frequency divided by `factor` (Gemma 3's global layers).
- `llama3`: Llama 3.1+: wavelengths longer than `original_max_position_embeddings / low_freq_factor` are
  divided by `factor`, shorter than `.. / high_freq_factor` kept, the band between blended smoothly.
- `yarn`: Qwen2.5/Qwen3 long context: per-dimension blend of interpolated (÷ factor) and original
  frequencies over a ramp between `beta_fast` and `beta_slow` rotations, and cos/sin scaled by
  0.1·ln(factor) + 1 (the attention factor), unless the config gives `attention_factor`.
Anything else (dynamic NTK, longrope) is refused by `RopeScaling.from_dict` with the list above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedRopeError(ValueError):
    """A rope type this engine does not compute."""


@dataclass(frozen=True)
class RopeScaling:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None is derived from `factor` (and mscale, mscale_all_dim)
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True  # yarn: round the ramp's ends outward

    @classmethod
    def from_dict(cls, params: dict | None, theta: float, max_positions: int) -> RopeScaling:
        """From a config's rope dict (None or {} is plain RoPE at `theta`)."""
        params = params or {}
        rope_type = params.get("rope_type", params.get("type")) or "default"
        if rope_type not in ROPE_TYPES:
            raise UnsupportedRopeError(
                f"rope scaling type {rope_type!r} is not supported; this engine runs {ROPE_TYPES}"
            )
        theta = float(params.get("rope_theta", theta))
        if rope_type == "default":
            return cls(theta=theta)
        original = int(params.get("original_max_position_embeddings") or max_positions)
        factor = params.get("factor")
        if factor is None:  # yarn may leave it to the two lengths
            factor = max_positions / original
        return cls(
            theta=theta,
            rope_type=rope_type,
            factor=float(factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            truncate=bool(params.get("truncate", True)),
        )

    def frequencies(self, dim: int) -> tuple[torch.Tensor, float]:
        """(inverse frequencies (dim/2,) fp32, the factor cos and sin are multiplied by)."""
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.rope_type == "linear":
            return inv / self.factor, 1.0
        if self.rope_type == "llama3":
            return self._llama3(inv), 1.0
        if self.rope_type == "yarn":
            return self._yarn(dim)
        return inv, 1.0

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def _yarn(self, dim: int) -> tuple[torch.Tensor, float]:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = self.attention_factor
        if attention is None:
            if self.mscale and self.mscale_all_dim:
                attention = mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
            else:
                attention = mscale(self.factor)

        def correction_dim(rotations: float) -> float:
            return (
                dim
                * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(self.theta))
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        keep = 1 - ramp  # 1: the original frequency, 0: interpolated
        return interpolation * (1 - keep) + extrapolation * keep, float(attention)
