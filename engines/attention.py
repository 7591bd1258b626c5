"""Attention backends: where queries meet the KV cache.

A backend gets per-layer q/k/v for the tokens of one forward pass plus metadata built once per pass,
writes the new keys and values into its cache and returns the attention output. v0 serves one
sequence per pass from a contiguous cache; the paged, batched backend of the engine core replaces it
behind the same `forward` call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engines.kv_cache import SequenceKVCache


@dataclass(frozen=True)
class AttentionMetadata:
    """One sequence's view for one forward pass, built once and shared by every layer."""

    cache: SequenceKVCache
    past_len: int  # tokens already cached before this pass
    num_new: int
    mask: torch.Tensor | None  # bool (new, past+new), True where attending is allowed

    @classmethod
    def for_sequence(cls, cache: SequenceKVCache, past_len: int, num_new: int) -> AttentionMetadata:
        mask = None
        # A single new token sees everything; a fresh prompt is plain causal (SDPA's is_causal).
        if num_new > 1 and past_len > 0:
            total = past_len + num_new
            rows = torch.arange(past_len, total).unsqueeze(1)
            mask = torch.arange(total).unsqueeze(0) <= rows
        return cls(cache, past_len, num_new, mask)


class AttentionBackend(Protocol):
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor: ...


class TorchAttention:
    """Pure-torch backend over `SequenceKVCache` using fused SDPA (GQA without repeating k/v)."""

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        end = meta.past_len + meta.num_new
        keys, values = meta.cache.write(layer, meta.past_len, k, v)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # (1, heads, new, dim)
            keys[:, :end].unsqueeze(0),
            values[:, :end].unsqueeze(0),
            attn_mask=meta.mask,
            is_causal=meta.mask is None and meta.num_new > 1,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)  # (new, heads, dim)
