"""v0 KV cache: one contiguous buffer per sequence, sized for its prompt plus its token budget.

Sized up front so decode never reallocates; the paged block pool of the engine core replaces this.
"""

from __future__ import annotations

import torch


class SequenceKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype) -> None:
        self.capacity = capacity
        # (layers, k|v, kv_heads, tokens, head_dim): tokens contiguous per head, as SDPA reads them.
        self.buffer = torch.empty(num_layers, 2, num_kv_heads, capacity, head_dim, dtype=dtype)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v (new, kv_heads, dim) at positions start.. and return this layer's full k and v."""
        end = start + k.shape[0]
        if end > self.capacity:
            raise IndexError(f"sequence of {end} tokens overflows its KV cache of {self.capacity}")
        layer_kv = self.buffer[layer]
        layer_kv[0, :, start:end] = k.transpose(0, 1)
        layer_kv[1, :, start:end] = v.transpose(0, 1)
        return layer_kv[0], layer_kv[1]
