"""The paged KV pool: one preallocated tensor per layer for keys and values, addressed by slot.

A slot is `block_id * block_size + offset`; the block manager hands out blocks, the model runner turns
them into slot indices once per step, and the attention backend writes through `store` and reads the
blocks back. Sized in bytes from config, so the number of blocks follows from the model's shape and dtype.

With `kv_dtype=torch.int8` each stored key or value vector (one token, one KV head) is kept as int8
with one scale, absmax / 127, in the model dtype beside it: 66 bytes instead of 128 for a bf16 vector
of 64, so about twice the blocks fit the same bytes. Attention folds the scales into its scores and
probabilities (see `engines.kernels.reference`); nothing dequantizes the pool. Each vector is quantized on its
own, so a token's stored bits do not depend on what else was in its step.
"""

from __future__ import annotations

import torch


def bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> int:
    """KV bytes one token takes in the pool (keys and values of every layer), scales included."""
    kv_dtype = kv_dtype or dtype
    scale = dtype.itemsize if kv_dtype == torch.int8 else 0
    return 2 * num_layers * num_kv_heads * (head_dim * kv_dtype.itemsize + scale)


def bytes_per_block(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
) -> int:
    return block_size * bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, kv_dtype)


def quantize(x: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., dim) → int8 (..., dim) and scales (...,) with x ≈ q * scale; all-zero vectors get scale 0."""
    scale = (x.abs().amax(-1).float() / 127).to(scale_dtype)
    divisor = scale.float().masked_fill(scale == 0, 1).unsqueeze(-1)  # the stored scale, so q·s tracks x
    q = torch.round(x.float() / divisor).clamp_(-127, 127).to(torch.int8)
    return q, scale


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        kv_dtype = kv_dtype or dtype
        if kv_dtype not in (dtype, torch.int8):
            raise ValueError(f"KV cache dtype {kv_dtype} must be the model's ({dtype}) or torch.int8")
        # (layers, k|v, kv_heads, blocks, block_size, head_dim): a block is one contiguous run per
        # head, so a gathered context is one contiguous (tokens, head_dim) matrix per head.
        # Empty, so starting does not touch every page; `zero_blocks` clears a block before its first
        # use, because attention reads masked slots too and 0 × NaN garbage would be NaN.
        self.buffer = torch.empty(
            num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim, dtype=kv_dtype, device=device
        )
        # int8 only: (layers, k|v, kv_heads, blocks, block_size), one scale per stored vector.
        self.scales = (
            torch.empty(num_layers, 2, num_kv_heads, num_blocks, block_size, dtype=dtype, device=device)
            if kv_dtype == torch.int8
            else None
        )

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values, each (kv_heads, blocks, block_size, head_dim)."""
        return self.buffer[layer, 0], self.buffer[layer, 1]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's key and value scales, each (kv_heads, blocks, block_size); None unless int8."""
        return None if self.scales is None else (self.scales[layer, 0], self.scales[layer, 1])

    def store(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v (tokens, kv_heads, dim) of this layer into their slots, quantizing if int8."""
        kv_heads, dim = self.buffer.shape[2], self.buffer.shape[-1]
        slot_mapping = slot_mapping.to(self.buffer.device)
        for i, x in enumerate((k, v)):
            if self.scales is not None:
                x, scale = quantize(x, self.dtype)
                self.scales[layer, i].view(kv_heads, -1).index_copy_(1, slot_mapping, scale.transpose(0, 1))
            self.buffer[layer, i].view(kv_heads, -1, dim).index_copy_(1, slot_mapping, x.transpose(0, 1))

    def zero_blocks(self, block_ids: list[int]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.buffer.device)
        self.buffer[:, :, :, ids] = 0
        if self.scales is not None:
            self.scales[:, :, :, ids] = 0

    @property
    def nbytes(self) -> int:
        scales = self.scales.numel() * self.scales.element_size() if self.scales is not None else 0
        return self.buffer.numel() * self.buffer.element_size() + scales
