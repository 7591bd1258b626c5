"""Attention over the paged KV cache, for batches that mix prefill chunks and decodes.

The model runner builds one `AttentionMetadata` per step; every layer reuses it. A batch lists its
one-token queries (decodes) first, then multi-token spans (prefill chunks). A backend stores the new
keys and values through `slot_mapping`, answers `forward_decode` for the first rows and
`forward_extend` for the spans; a Triton backend slots in beside this one behind the same calls.

Batch invariance: a token's attention output must not depend on what else shares the step, or greedy
answers would change with server load. On this CPU, bf16 SDPA with an explicit mask gives bit-identical
rows for every key width that is a multiple of 16 and any batch size, and a decode row equals the
same row of a full prefill when the query heads that share a KV head are folded into the query axis.
So every path here uses that one form: folded queries, masked keys, widths padded to 16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engines.kv_cache import PagedKVCache

WIDTH_MULTIPLE = 16  # key widths are padded to this many tokens (see the module docstring)


@dataclass(frozen=True)
class ExtendSpan:
    """One sequence's multi-token chunk: rows [start, start + num_new) of the batch."""

    start: int
    num_new: int
    block_ids: torch.Tensor  # blocks holding its whole context, padded to the key width
    mask: torch.Tensor  # (num_new * group, width) bool: cached prefix and, causally, the chunk itself


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) cache slot of each new token's key and value
    num_decode: int  # the first rows: one query token per sequence
    decode_block_tables: torch.Tensor | None  # (num_decode, blocks), padded with block 0
    decode_mask: torch.Tensor | None  # (num_decode, 1, 1, blocks * block_size) bool
    extends: tuple[ExtendSpan, ...]

    @classmethod
    def build(
        cls,
        block_size: int,
        group: int,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: list[int],
    ) -> AttentionMetadata:
        """Metadata for sequences in batch order, one-token queries first.

        `group`: query heads per KV head. `block_tables[i]` must cover `num_computed[i] + num_new[i]`.
        """
        # Pad tables to whole multiples of WIDTH_MULTIPLE tokens whatever the block size.
        pad_to = WIDTH_MULTIPLE // math.gcd(block_size, WIDTH_MULTIPLE)
        slots: list[torch.Tensor] = []
        num_decode = 0
        while num_decode < len(num_new) and num_new[num_decode] == 1:
            num_decode += 1
        decode_tables = decode_mask = None
        if num_decode:
            tables = block_tables[:num_decode]
            width = -(-max(len(t) for t in tables) // pad_to) * pad_to
            decode_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            pos = torch.tensor(num_computed[:num_decode], dtype=torch.long)
            block_of = decode_tables.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
            slots.append(block_of * block_size + pos % block_size)
            decode_mask = (torch.arange(width * block_size) <= pos.unsqueeze(1))[:, None, None, :]
        extends = []
        row = num_decode
        rest = zip(block_tables[num_decode:], num_computed[num_decode:], num_new[num_decode:], strict=True)
        for table, done, n in rest:
            ctx = done + n
            used = -(-ctx // block_size)
            blocks = -(-used // pad_to) * pad_to
            ids = torch.tensor(table[:used] + [0] * (blocks - used), dtype=torch.long)
            positions = torch.arange(done, ctx)
            slots.append(ids[positions // block_size] * block_size + positions % block_size)
            mask = torch.arange(blocks * block_size).unsqueeze(0) <= positions.unsqueeze(1)
            extends.append(ExtendSpan(row, n, ids, mask.repeat_interleave(group, dim=0)))
            row += n
        slot_mapping = torch.cat(slots) if slots else torch.empty(0, dtype=torch.long)
        return cls(slot_mapping, num_decode, decode_tables, decode_mask, tuple(extends))


class AttentionBackend(Protocol):
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Store k/v for this layer and return attention over each sequence's whole context."""
        ...


class TorchPagedAttention:
    """Pure-torch paged attention: gathers each sequence's blocks and runs fused SDPA."""

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
        if not meta.extends:
            return self.forward_decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self.forward_decode(q[: meta.num_decode], k_cache, v_cache, meta)
        for span in meta.extends:
            rows = slice(span.start, span.start + span.num_new)
            out[rows] = self.forward_extend(q[rows], k_cache, v_cache, span)
        return out

    def forward_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One query per sequence, batched: (b, heads, dim) → (b, heads, dim)."""
        tables = meta.decode_block_tables
        assert tables is not None
        b, blocks = tables.shape
        _, bs, kv_heads, dim = k_cache.shape
        flat = tables.view(-1)
        keys = k_cache.index_select(0, flat).view(b, blocks * bs, kv_heads, dim).transpose(1, 2)
        values = v_cache.index_select(0, flat).view(b, blocks * bs, kv_heads, dim).transpose(1, 2)
        group = q.shape[1] // kv_heads
        # The query heads sharing a KV head become its query rows: plain MHA, no GQA expansion.
        out = F.scaled_dot_product_attention(q.view(b, kv_heads, group, dim), keys, values, attn_mask=meta.decode_mask)
        return out.reshape(b, kv_heads * group, dim)

    def forward_extend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: ExtendSpan
    ) -> torch.Tensor:
        """One sequence's chunk against its whole context: (n, heads, dim) → (n, heads, dim)."""
        n, heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        group = heads // kv_heads
        keys = k_cache.index_select(0, span.block_ids).view(1, -1, kv_heads, dim).transpose(1, 2)
        values = v_cache.index_select(0, span.block_ids).view(1, -1, kv_heads, dim).transpose(1, 2)
        folded = q.view(n, kv_heads, group, dim).transpose(0, 1).reshape(1, kv_heads, n * group, dim)
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=span.mask)
        return out.view(kv_heads, n, group, dim).transpose(0, 1).reshape(n, heads, dim)
