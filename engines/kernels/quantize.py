"""Weight quantization formats: int8 per output channel and int4 in groups along the input.

Both are the formats torch's CPU kernels consume (`engines.layers.linear` packs them at load):
- int8: `q` int8 (N, K), symmetric, one scale per output row: w = q * scale.
- int4: `q` holds two 4-bit values per byte, (N, K/2) uint8, low nibble = even column; one scale and
  one zero per group of `group_size` inputs: w = (q - 8) * scale + zero (torch's int4 convention, in
  which the zero lives in the float domain). That form holds GGUF's Q4_0, Q4_1 and Q4_K blocks exactly,
  so a 4-bit GGUF file needs no re-quantization (`engines.checkpoints.gguf_quant`).
Scales and zeros are kept in fp32 here; they are rounded to the activation dtype when packed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

WeightFormat = Literal["bf16", "int8", "int4"]
WEIGHT_FORMATS: tuple[str, ...] = ("bf16", "int8", "int4")
INT4_GROUP = 32  # the group of every GGUF 4-bit format, and the finest torch's kernel takes
# Per-token int8 activations cost SmolLM2 3.9% perplexity; keeping its 32 largest input channels out
# of them costs 0.6% (8: 1.1%; SmoothQuant's α=0.5 smoothing: 1.8%), measured on 4,096 held-out tokens.
OUTLIER_CHANNELS = 32


@dataclass
class QuantizedWeight:
    format: Literal["int8", "int4"]
    q: torch.Tensor  # int8 (N, K) | uint8 (N, K/2)
    scales: torch.Tensor  # fp32 (N,) | fp32 (N, K/group)
    zeros: torch.Tensor | None = None  # int4: fp32 (N, K/group)
    group_size: int = 0  # int4 only
    # int8 only, int64 (k,): input channels whose activations run far above the rest (found by
    # calibration). int8×int8 leaves them out of the per-token int8 activations and adds their
    # product in floating point (LLM.int8()'s decomposition, with the channels fixed in advance).
    outliers: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.q.shape
        return (n, k * 2) if self.format == "int4" else (n, k)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.zeros is None else self.zeros.numel() * 4
        return self.q.numel() + self.scales.numel() * 4 + extra

    def unpacked(self) -> torch.Tensor:
        """int4 codes as int32 (N, K) in 0..15; int8 codes as int32."""
        if self.format == "int8":
            return self.q.to(torch.int32)
        return unpack_int4(self.q)

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix these codes stand for: the reference every kernel is tested against."""
        if self.format == "int8":
            return self.q.float() * self.scales[:, None]
        n, k = self.shape
        codes = unpack_int4(self.q).view(n, k // self.group_size, self.group_size).float()
        assert self.zeros is not None
        return ((codes - 8) * self.scales[..., None] + self.zeros[..., None]).view(n, k)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight with its tensors on `device`."""
        moved = [None if t is None else t.to(device) for t in (self.q, self.scales, self.zeros, self.outliers)]
        return QuantizedWeight(self.format, moved[0], moved[1], moved[2], self.group_size, moved[3])  # type: ignore[arg-type]

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The same weight with its output rows reordered (e.g. undoing llama.cpp's RoPE permutation)."""
        zeros = None if self.zeros is None else self.zeros[index]
        return QuantizedWeight(self.format, self.q[index], self.scales[index], zeros, self.group_size, self.outliers)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) integer codes in 0..15 → (N, K/2) uint8, low nibble = even column."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    low = (packed & 0x0F).to(torch.int32)
    high = (packed >> 4).to(torch.int32)
    return torch.stack((low, high), dim=-1).view(packed.shape[0], -1)


def quantize_int8(w: torch.Tensor, outliers: torch.Tensor | None = None) -> QuantizedWeight:
    """Symmetric per-output-channel int8 (round to nearest, ±127)."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, scales, outliers=outliers)


def outlier_channels(act_absmax: torch.Tensor, count: int = OUTLIER_CHANNELS) -> torch.Tensor:
    """The input channels with the largest calibrated |activation| (at most 1/8 of them), sorted."""
    k = min(count, act_absmax.numel() // 8)
    return act_absmax.float().topk(k).indices.sort().values


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP) -> QuantizedWeight:
    """Asymmetric group-wise int4 from each group's min and max (as GGUF Q4_1 does)."""
    w = w.float()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 needs the input size {k} to be a multiple of the group size {group_size}")
    groups = w.view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-12)
    codes = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, 15)
    return QuantizedWeight("int4", pack_int4(codes.view(n, k)), scales, lo + 8 * scales, group_size)


def quantize(w: torch.Tensor, fmt: Literal["int8", "int4"]) -> QuantizedWeight:
    return quantize_int8(w) if fmt == "int8" else quantize_int4(w)


def can_int4(n: int, k: int, group_size: int = INT4_GROUP) -> bool:
    """torch's CPU int4 packing wants N a multiple of 16 and K a multiple of the group."""
    return n % 16 == 0 and k % group_size == 0


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format along the output axis (q, k, v → qkv)."""
    first = parts[0]
    if any(p.format != first.format or p.group_size != first.group_size for p in parts):
        raise ValueError("cannot fuse weights of different formats")
    if any(p.outliers is not None for p in parts):
        raise ValueError("calibrated weights are quantized fused, never concatenated")
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])  # type: ignore[misc]
    return QuantizedWeight(
        first.format,
        torch.cat([p.q for p in parts]),
        torch.cat([p.scales for p in parts]),
        zeros,
        first.group_size,
    )
