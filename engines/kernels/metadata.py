"""What an attention backend reads each step: where the batch's new and cached keys and values are in the
paged KV pool (`engines.kv.cache`), and the interface every backend implements.

The model runner builds one `AttentionMetadata` per step; every layer reuses it. A batch lists its
one-token queries (decodes) first, then multi-token spans (prefill chunks). A backend stores the new
keys and values through `slot_mapping`, answers the decode rows (grouped by context length, padded to
one key width per group) and the extend spans; `rows` gives the same per query row, unpadded, for
kernels that walk each row's blocks themselves. Backends: `engines.kernels.reference.TorchPagedAttention`
(the reference), `engines.kernels.cpu_attention` and `engines.kernels.triton_attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

WIDTH_MULTIPLE = 16  # key widths are padded to this many tokens
GROUP_COST_BLOCKS = 48  # a decode group's fixed cost (its ~8 ops per layer), in padded blocks gathered


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows [start, end) padded to one key width: the batch's decodes split by context length."""

    start: int
    end: int
    block_tables: torch.Tensor  # (rows, blocks), padded with block 0
    mask: torch.Tensor  # (rows, 1, 1, blocks * block_size) bool, True = attend


@dataclass(frozen=True)
class ExtendSpan:
    """One sequence's multi-token chunk: rows [start, start + num_new) of the batch."""

    start: int
    num_new: int
    num_computed: int  # tokens cached before this chunk (its first position)
    block_ids: torch.Tensor  # blocks holding its whole context, padded to a multiple of 16 tokens


@dataclass(frozen=True)
class RowTables:
    """Per query row, where its sequence's blocks are and how many positions it sees: the form the
    native backend (`engines.kernels.cpu_attention`) reads, unpadded."""

    tables: torch.Tensor  # int32, every sequence's block ids back to back
    row_table: torch.Tensor  # int32 (num_tokens,): where row t's sequence starts in `tables`
    row_len: torch.Tensor  # int32 (num_tokens,): positions row t attends to (its own position + 1)

    @classmethod
    def build(cls, block_tables: list[list[int]], num_computed: list[int], num_new: list[int]) -> RowTables:
        flat: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        for table, done, n in zip(block_tables, num_computed, num_new, strict=True):
            starts += [len(flat)] * n
            lens += range(done + 1, done + n + 1)
            flat += table
        return cls(*(torch.tensor(values, dtype=torch.int32) for values in (flat, starts, lens)))


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) cache slot of each new token's key and value
    decode_groups: tuple[DecodeGroup, ...]  # the first rows, one query token per sequence
    extends: tuple[ExtendSpan, ...]
    rows: RowTables
    # int32 (3, len(extends)): the spans' start rows, new tokens and cached tokens, for kernels that take
    # them as tensors (built once per step, not once per layer)
    extend_spans: torch.Tensor

    @property
    def num_decode(self) -> int:
        return self.decode_groups[-1].end if self.decode_groups else 0

    @classmethod
    def build(
        cls, block_size: int, block_tables: list[list[int]], num_computed: list[int], num_new: list[int]
    ) -> AttentionMetadata:
        """Metadata for sequences in batch order, one-token queries first (shortest context first
        pads least). `block_tables[i]` must cover `num_computed[i] + num_new[i]` tokens."""
        pad_to = WIDTH_MULTIPLE // math.gcd(block_size, WIDTH_MULTIPLE)  # blocks per 16-token multiple
        slots: list[torch.Tensor] = []
        num_decode = 0
        while num_decode < len(num_new) and num_new[num_decode] == 1:
            num_decode += 1
        groups = []
        if num_decode:
            widths = [-(-len(t) // pad_to) * pad_to for t in block_tables[:num_decode]]
            for lo, hi in _split_by_width(widths):
                tables = block_tables[lo:hi]
                width = max(widths[lo:hi])
                padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
                pos = torch.tensor(num_computed[lo:hi], dtype=torch.long)
                block_of = padded.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
                slots.append(block_of * block_size + pos % block_size)
                mask = (torch.arange(width * block_size) <= pos.unsqueeze(1))[:, None, None, :]
                groups.append(DecodeGroup(lo, hi, padded, mask))
        extends = []
        row = num_decode
        rest = zip(block_tables[num_decode:], num_computed[num_decode:], num_new[num_decode:], strict=True)
        for table, done, n in rest:
            used = -(-(done + n) // block_size)
            blocks = -(-used // pad_to) * pad_to
            ids = torch.tensor(table[:used] + [0] * (blocks - used), dtype=torch.long)
            positions = torch.arange(done, done + n)
            slots.append(ids[positions // block_size] * block_size + positions % block_size)
            extends.append(ExtendSpan(row, n, done, ids))
            row += n
        slot_mapping = torch.cat(slots) if slots else torch.empty(0, dtype=torch.long)
        spans = torch.tensor([[e.start, e.num_new, e.num_computed] for e in extends], dtype=torch.int32)
        rows = RowTables.build(block_tables, num_computed, num_new)
        return cls(slot_mapping, tuple(groups), tuple(extends), rows, spans.reshape(-1, 3).t().contiguous())

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """The same metadata on `device` (itself on the CPU): moved once per step, not once per layer."""
        if torch.device(device).type == "cpu":
            return self
        groups = tuple(
            DecodeGroup(g.start, g.end, g.block_tables.to(device), g.mask.to(device)) for g in self.decode_groups
        )
        extends = tuple(ExtendSpan(e.start, e.num_new, e.num_computed, e.block_ids.to(device)) for e in self.extends)
        rows = RowTables(self.rows.tables.to(device), self.rows.row_table.to(device), self.rows.row_len.to(device))
        return AttentionMetadata(self.slot_mapping.to(device), groups, extends, rows, self.extend_spans.to(device))


class AttentionBackend(Protocol):
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
        """Store k/v for this layer and return attention over each sequence's whole context, or over the
        last `window` positions up to each query's own (0: all); scores scaled by `scale` (None: D^-0.5)."""
        ...


def _split_by_width(widths: list[int]) -> list[tuple[int, int]]:
    """Contiguous groups of rows minimising padded blocks gathered plus a fixed cost per group.

    `widths` ascending (the runner sorts decodes by context); a small O(n²) dynamic program.
    """
    n = len(widths)
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * widths[j - 1] + GROUP_COST_BLOCKS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], n
    while j:
        bounds.append((cut[j], j))
        j = cut[j]
    return bounds[::-1]
