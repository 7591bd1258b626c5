"""The paged KV pool: one preallocated tensor per layer for keys and values, addressed by slot.

A slot is `block_id * block_size + offset`; the block manager hands out blocks, the model runner turns
them into slot indices once per step, and the attention backend reads and writes through them.
Sized in bytes from config, so the number of blocks follows from the model's shape and dtype.
"""

from __future__ import annotations

import torch


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


class PagedKVCache:
    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # (layers, k|v, kv_heads, blocks, block_size, head_dim): a block is one contiguous run per
        # head, so a gathered context is one contiguous (tokens, head_dim) matrix per head.
        # Empty, so starting does not touch every page; `zero_blocks` clears a block before its first
        # use, because attention reads masked slots too and 0 × NaN garbage would be NaN.
        self.buffer = torch.empty(num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values, each (kv_heads, blocks, block_size, head_dim)."""
        return self.buffer[layer, 0], self.buffer[layer, 1]

    def zero_blocks(self, block_ids: list[int]) -> None:
        self.buffer[:, :, :, torch.tensor(block_ids, dtype=torch.long)] = 0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
