"""Attention over the paged KV cache, for batches that mix prefill chunks and decodes.

The model runner builds one `AttentionMetadata` per step; every layer reuses it. A batch lists its
one-token queries (decodes, and prefills with all but their last token cached) first, then the
multi-token spans (prefill chunks). A backend stores the new keys and values through `slot_mapping`
and answers `forward_decode` for the first rows and `forward_extend` for the spans; a Triton backend
slots in beside this one behind the same two calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engines.kv_cache import PagedKVCache


@dataclass(frozen=True)
class ExtendSpan:
    """One sequence's multi-token chunk: rows [start, start + num_new) of the batch."""

    start: int
    num_new: int
    context_len: int  # tokens it attends to: cached ones plus this chunk
    block_ids: torch.Tensor | None  # its blocks when part of the context was cached before; else None
    mask: torch.Tensor | None  # (num_new, context_len) bool, True where attending is allowed


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) cache slot of each new token's key and value
    num_decode: int  # the first rows: one query token per sequence
    decode_block_tables: torch.Tensor | None  # (num_decode, max_blocks), padded with block 0
    decode_mask: torch.Tensor | None  # (num_decode, 1, 1, max_blocks * block_size); None: no padding
    decode_context_len: int  # with a single decode sequence, its context length (no mask needed)
    extends: tuple[ExtendSpan, ...]

    @classmethod
    def build(
        cls,
        block_size: int,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: list[int],
    ) -> AttentionMetadata:
        """Metadata for sequences given in batch order, one-token queries first."""
        slots: list[torch.Tensor] = []
        num_decode = 0
        while num_decode < len(num_new) and num_new[num_decode] == 1:
            num_decode += 1
        decode_tables = decode_mask = None
        decode_ctx = 0
        if num_decode:
            lens = [c + 1 for c in num_computed[:num_decode]]
            tables = block_tables[:num_decode]
            width = max(len(t) for t in tables)
            decode_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            pos = torch.tensor(num_computed[:num_decode], dtype=torch.long)
            block_of = decode_tables.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
            slots.append(block_of * block_size + pos % block_size)
            if num_decode == 1:
                decode_ctx = lens[0]
            elif any(n != width * block_size for n in lens):
                ctx = torch.tensor(lens, dtype=torch.long)
                decode_mask = (torch.arange(width * block_size) < ctx.unsqueeze(1))[:, None, None, :]
        extends = []
        row = num_decode
        for table, done, n in zip(
            block_tables[num_decode:], num_computed[num_decode:], num_new[num_decode:], strict=True
        ):
            ids = torch.tensor(table, dtype=torch.long)
            positions = torch.arange(done, done + n)
            slots.append(ids[positions // block_size] * block_size + positions % block_size)
            ctx = done + n
            mask = None
            if done:  # queries see the cached prefix and, causally, each other
                mask = torch.arange(ctx).unsqueeze(0) <= positions.unsqueeze(1)
            extends.append(ExtendSpan(row, n, ctx, ids if done else None, mask))
            row += n
        slot_mapping = torch.cat(slots) if slots else torch.empty(0, dtype=torch.long)
        return cls(slot_mapping, num_decode, decode_tables, decode_mask, decode_ctx, tuple(extends))


class AttentionBackend(Protocol):
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Store k/v for this layer and return attention over each sequence's whole context."""
        ...


class TorchPagedAttention:
    """Pure-torch paged attention: gathers each sequence's blocks and runs fused SDPA (GQA-aware)."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q (tokens, heads, dim), k/v (tokens, kv_heads, dim) → (tokens, heads, dim)."""
        k_cache, v_cache = self.cache.layer(layer)
        _, _, kv_heads, dim = k_cache.shape
        k_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, v)
        nd = meta.num_decode
        if not meta.extends:
            return self.forward_decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.forward_decode(q[:nd], k_cache, v_cache, meta)
        self.forward_extend(q, k, v, k_cache, v_cache, meta, out)
        return out

    def forward_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        tables = meta.decode_block_tables
        assert tables is not None
        b, width = tables.shape
        _, bs, kv_heads, dim = k_cache.shape
        flat = tables.view(-1)
        keys = k_cache.index_select(0, flat).view(b, width * bs, kv_heads, dim)
        values = v_cache.index_select(0, flat).view(b, width * bs, kv_heads, dim)
        if b == 1:
            keys, values = keys[:, : meta.decode_context_len], values[:, : meta.decode_context_len]
        # One query token per sequence: the query heads sharing a KV head become that head's query
        # rows, so SDPA runs plain MHA over (b, kv_heads) with no GQA expansion (5x faster in bf16).
        group = q.shape[1] // kv_heads
        out = F.scaled_dot_product_attention(
            q.view(b, kv_heads, group, dim),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=meta.decode_mask,
        )
        return out.reshape(b, kv_heads * group, dim)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        kv_heads, dim = k_cache.shape[2:]
        for span in meta.extends:
            rows = slice(span.start, span.start + span.num_new)
            if span.block_ids is None:  # nothing cached before: the chunk's own keys are the context
                keys, values = k[rows], v[rows]
            else:
                keys = k_cache.index_select(0, span.block_ids).view(-1, kv_heads, dim)[: span.context_len]
                values = v_cache.index_select(0, span.block_ids).view(-1, kv_heads, dim)[: span.context_len]
            out[rows] = (
                F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1).unsqueeze(0),  # (1, heads, new, dim)
                    keys.transpose(0, 1).unsqueeze(0),
                    values.transpose(0, 1).unsqueeze(0),
                    attn_mask=span.mask,
                    is_causal=span.mask is None,
                    enable_gqa=True,
                )
                .squeeze(0)
                .transpose(0, 1)
            )
