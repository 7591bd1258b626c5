"""Paged attention on a mixed batch against plain per-sequence attention on contiguous tensors."""

from __future__ import annotations

import pytest
import torch

from engines.kernels.metadata import AttentionMetadata
from engines.kernels.reference import TorchPagedAttention
from engines.kv.cache import PagedKVCache

HEADS, KV_HEADS, DIM, BS, BLOCKS = 6, 2, 8, 4, 64


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """q (new, heads, dim) against k/v (past + new, kv_heads, dim), causal, computed naively in fp64."""
    group = HEADS // KV_HEADS
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / DIM**0.5
    allowed = torch.arange(k.shape[0])[None, :] <= (past + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_mixed_batch_matches_per_sequence_attention(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, KV_HEADS, DIM, BLOCKS, BS, dtype)
    cache.buffer.normal_(0, 1e4, generator=gen)  # stale keys of freed blocks: must be masked out
    free = torch.randperm(BLOCKS, generator=gen).tolist()
    # (tokens already cached, tokens new this step): decodes first, then chunks, as the runner orders them
    shapes = [(9, 1), (3, 1), (16, 1), (0, 1), (0, 7), (12, 5), (5, 11)]
    tables, full_k, full_v = [], [], []
    for past, new in shapes:
        n_blocks = -(-(past + new) // BS)
        tables.append([free.pop() for _ in range(n_blocks)])
        full_k.append(torch.randn(past + new, KV_HEADS, DIM, generator=gen).to(dtype))
        full_v.append(torch.randn(past + new, KV_HEADS, DIM, generator=gen).to(dtype))
    k_cache, v_cache = cache.layer(0)
    for table, (past, _), k, v in zip(tables, shapes, full_k, full_v, strict=True):
        for pos in range(past):  # what earlier steps stored
            k_cache[:, table[pos // BS], pos % BS] = k[pos]
            v_cache[:, table[pos // BS], pos % BS] = v[pos]
    q = [torch.randn(new, HEADS, DIM, generator=gen).to(dtype) for _, new in shapes]
    meta = AttentionMetadata.build(BS, tables, [p for p, _ in shapes], [n for _, n in shapes])
    assert meta.num_decode == 4 and len(meta.extends) == 3
    new_k = torch.cat([k[p:] for k, (p, _) in zip(full_k, shapes, strict=True)])
    new_v = torch.cat([v[p:] for v, (p, _) in zip(full_v, shapes, strict=True)])
    out = TorchPagedAttention(cache).forward(0, torch.cat(q), new_k, new_v, meta)
    row = 0
    for qi, k, v, (past, new) in zip(q, full_k, full_v, shapes, strict=True):
        expected = reference(qi, k, v, past)
        assert (out[row : row + new].double() - expected).abs().max().item() < tol
        row += new
    for table, k, (past, new) in zip(tables, full_k, shapes, strict=True):  # the new keys were stored
        for pos in range(past, past + new):
            assert torch.equal(k_cache[:, table[pos // BS], pos % BS], k[pos])


def test_blocks_are_zeroed_before_their_first_use() -> None:
    from engines.block_manager import BlockManager, BlockTable

    cache = PagedKVCache(1, KV_HEADS, DIM, 8, BS, torch.bfloat16)
    cache.buffer.fill_(float("nan"))  # what never-written memory may hold
    bm = BlockManager(8, BS)
    table = BlockTable("m")
    bm.allocate(table, 3)
    assert sorted(bm.first_use) == sorted(table.block_ids)
    cache.zero_blocks(bm.first_use)
    bm.first_use.clear()
    assert not cache.buffer[:, :, :, table.block_ids].isnan().any()
    bm.free(table)
    bm.allocate(BlockTable("m"), 3)
    assert bm.first_use == []  # reused blocks hold finite stale data: masked, never NaN


def test_key_widths_are_padded_to_multiples_of_16() -> None:
    meta = AttentionMetadata.build(BS, [[3, 1, 2], [5]], [9, 2], [1, 1])
    assert meta.slot_mapping.tolist() == [2 * BS + 1, 5 * BS + 2]
    (group,) = meta.decode_groups
    assert group.block_tables.tolist() == [[3, 1, 2, 0], [5, 0, 0, 0]]
    assert group.mask.shape == (2, 1, 1, 16) and group.mask[:, 0, 0].sum(-1).tolist() == [10, 3]
    chunk = AttentionMetadata.build(BS, [[7, 8]], [2], [5]).extends[0]
    assert chunk.block_ids.tolist() == [7, 8, 0, 0] and chunk.num_computed == 2


def test_decodes_of_very_different_lengths_are_padded_in_separate_groups() -> None:
    short, long = [[i] for i in range(20)], [list(range(100 + 60 * i, 160 + 60 * i)) for i in range(20)]
    tables = short + long  # contexts of 3 and 239 tokens: one width for all would pad 20 rows 60x
    meta = AttentionMetadata.build(BS, tables, [2] * 20 + [238] * 20, [1] * 40)
    assert [(g.start, g.end, g.block_tables.shape[1]) for g in meta.decode_groups] == [(0, 20, 4), (20, 40, 60)]
    similar = AttentionMetadata.build(BS, [[1, 2, 3]] * 8 + [[4, 5, 6, 7]] * 8, [10] * 8 + [13] * 8, [1] * 16)
    assert len(similar.decode_groups) == 1  # a group costs more than the padding it would save


def test_a_token_gets_the_same_bits_however_it_is_batched_or_chunked() -> None:
    """bf16: a sequence's outputs are identical alone, in a batch, chunked, or after a cached prefix."""
    gen = torch.Generator().manual_seed(3)
    dtype, n = torch.bfloat16, 37
    k = torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype)
    q = torch.randn(n, HEADS, DIM, generator=gen).to(dtype)
    table = list(range(-(-n // BS)))

    def attend(pieces: list[tuple[int, int]], others: int) -> torch.Tensor:
        """Compute positions piece by piece; `others` unrelated decodes share every step."""
        cache = PagedKVCache(1, KV_HEADS, DIM, BLOCKS, BS, dtype)
        cache.buffer.normal_(generator=gen)
        backend, outs = TorchPagedAttention(cache), []
        for start, end in pieces:
            noise_tables = [[BLOCKS - 1 - i] for i in range(others)]
            meta = AttentionMetadata.build(
                BS,
                [*noise_tables, table],
                [2] * others + [start],
                [1] * others + [end - start],
            )
            noise_q = torch.randn(others, HEADS, DIM, generator=gen).to(dtype)
            noise_kv = torch.randn(others, KV_HEADS, DIM, generator=gen).to(dtype)
            out = backend.forward(
                0,
                torch.cat([noise_q, q[start:end]]),
                torch.cat([noise_kv, k[start:end]]),
                torch.cat([noise_kv, v[start:end]]),
                meta,
            )
            outs.append(out[others:])
        return torch.cat(outs)

    whole = attend([(0, n)], 0)
    assert torch.equal(attend([(0, 16), (16, 30), (30, 36), (36, 37)], 0), whole)  # chunks, then a decode
    assert torch.equal(attend([(0, 5), (5, 37)], 7), whole)  # beside 7 other sequences
    assert torch.equal(attend([(i, i + 1) for i in range(n)], 3), whole)  # token by token
