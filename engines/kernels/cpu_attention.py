"""Attention over the paged KV cache in our CPU library: the `AttentionBackend` the model runner picks
where `engines.kernels.cpu_ops` builds, `engines.kernels.reference.TorchPagedAttention` elsewhere.

Every query row, decode or prefill, is one call's worth of the same fp32 loop over its own context
(scores, softmax, weighted values), so a token's output does not depend on what shares its step, how
its prompt was chunked, or whether its prefix came from the cache. On 2 AVX2 cores it replaces bf16
matmuls that run ~4 GFLOP/s there (38 ms of a 16-sequence Qwen 1.5B step; see `engines.kernels.cpu_ops`).
"""

from __future__ import annotations

import torch

from engines.kernels import cpu_ops
from engines.kernels.metadata import AttentionMetadata
from engines.kv.cache import PagedKVCache

MAX_GROUP = 16  # query heads per KV head the kernel holds accumulators for


def supports(cache: PagedKVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    probe = torch.empty(0, dtype=cache.dtype)
    return num_heads // num_kv_heads <= MAX_GROUP and cpu_ops.usable(probe, head_dim)


class NativePagedAttention:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        *,
        window: int = 0,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q (tokens, heads, dim), k/v (tokens, kv_heads, dim) → (tokens, heads, dim); `window` and `scale`
        as `AttentionBackend.forward`."""
        self.cache.store(layer, meta.slot_mapping, k, v)
        k_cache, v_cache = self.cache.layer(layer)
        rows = meta.rows
        return cpu_ops.paged_attention(
            q, k_cache, v_cache, self.cache.layer_scales(layer), rows.tables, rows.row_table, rows.row_len,
            window=window, scale=scale,
        )  # fmt: skip
