"""The block manager on its own: allocation, reference counts, prefix hits, collisions and LRU eviction."""

from __future__ import annotations

import pytest

from engines import block_manager as bm_module
from engines.block_manager import BlockManager, BlockTable

BS = 4


def prompt(n: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(n)]


def computed(bm: BlockManager, tokens: list[int], salt: str = "m") -> BlockTable:
    """A sequence whose `tokens` are all computed: allocated, then registered in the prefix cache."""
    table = BlockTable(salt)
    hit = bm.match_prefix(table, tokens)
    bm.allocate(table, bm.blocks_needed(table, len(tokens)))
    bm.cache_full_blocks(table, tokens, len(tokens))
    assert hit <= len(tokens) - 1
    return table


def test_allocate_and_free_count_blocks() -> None:
    bm = BlockManager(8, BS)
    table = BlockTable("m")
    assert bm.blocks_needed(table, 9) == 3
    bm.allocate(table, 3)
    assert len(table) == 3 and len(set(table.block_ids)) == 3
    assert bm.blocks_needed(table, 12) == 0 and bm.blocks_needed(table, 13) == 1
    s = bm.stats()
    assert (s.used, s.free, s.cached) == (3, 5, 0)
    assert not bm.can_allocate(6)
    with pytest.raises(MemoryError):
        bm.allocate(BlockTable("m"), 6)
    bm.free(table)
    assert table.block_ids == [] and bm.stats().used == 0 and bm.num_free == 8


def test_a_shared_prefix_is_computed_once_and_reference_counted() -> None:
    bm = BlockManager(16, BS)
    first = computed(bm, prompt(10))  # blocks [0-3] [4-7] full, [8-9] partial
    assert bm.stats().cached == 2
    second = BlockTable("m")
    hit = bm.match_prefix(second, [*prompt(10), 99, 98])
    assert hit == 8 and second.block_ids == first.block_ids[:2]
    assert [bm.blocks[b].ref_count for b in second.block_ids] == [2, 2]
    bm.free(first)
    assert [bm.blocks[b].ref_count for b in second.block_ids] == [1, 1]
    assert bm.stats().used == 2  # still held by the second sequence
    bm.free(second)
    s = bm.stats()
    assert (s.used, s.cached) == (0, 2)  # unreferenced, still cached
    third = BlockTable("m")
    assert bm.match_prefix(third, prompt(9)) == 8  # a later sequence still hits them


def test_the_last_token_is_never_a_hit() -> None:
    bm = BlockManager(16, BS)
    computed(bm, prompt(8))
    table = BlockTable("m")
    assert bm.match_prefix(table, prompt(8)) == 4  # 8 would leave nothing to compute logits from
    bm.free(table)
    assert bm.match_prefix(BlockTable("m"), prompt(9)) == 8


def test_hits_need_the_same_salt_and_the_same_chain() -> None:
    bm = BlockManager(16, BS)
    computed(bm, prompt(12), salt="model|tenant-a")
    assert bm.match_prefix(BlockTable("model|tenant-b"), prompt(12)) == 0
    # the same second block after a different first block is a different block
    other_first = [50, 51, 52, 53, *prompt(8)[4:]]
    assert bm.match_prefix(BlockTable("model|tenant-a"), other_first) == 0
    assert bm.match_prefix(BlockTable("model|tenant-a"), prompt(12)) == 8


def test_a_hash_collision_is_not_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens, salt: 42)  # every block collides
    bm = BlockManager(16, BS)
    computed(bm, prompt(5))
    assert bm.match_prefix(BlockTable("m"), prompt(5, offset=100)) == 0  # same hash, other tokens
    assert bm.match_prefix(BlockTable("m"), prompt(5)) == 4


def test_eviction_takes_empty_blocks_first_then_least_recently_used() -> None:
    bm = BlockManager(6, BS)
    old = computed(bm, prompt(8, offset=0))  # 2 cached blocks
    new = computed(bm, prompt(8, offset=100))  # 2 cached blocks
    scratch = BlockTable("m")
    bm.allocate(scratch, 2)  # never full: nothing to cache
    scratch_ids = set(scratch.block_ids)
    bm.free(old)
    bm.free(new)
    bm.free(scratch)
    assert bm.stats().cached == 4 and bm.num_free == 6
    taker = BlockTable("m")
    bm.allocate(taker, 2)
    assert set(taker.block_ids) == scratch_ids and bm.stats().evictions == 0
    bm.allocate(taker, 1)  # the least recently freed cached block goes: the old prompt's tail
    assert bm.stats().evictions == 1
    assert bm.match_prefix(BlockTable("m"), prompt(9, offset=0)) == 4
    assert bm.match_prefix(BlockTable("m"), prompt(9, offset=100)) == 8


def test_a_hit_revives_a_free_cached_block() -> None:
    bm = BlockManager(4, BS)
    bm.free(computed(bm, prompt(8)))
    revived = BlockTable("m")
    assert bm.match_prefix(revived, prompt(9)) == 8
    assert bm.num_free == 2  # the two hit blocks left the free queue
    filler = BlockTable("m")
    bm.allocate(filler, 2)
    assert not bm.can_allocate(1) and bm.stats().evictions == 0  # hit blocks are never evicted in use


def test_duplicate_blocks_keep_the_first_cached_copy() -> None:
    bm = BlockManager(16, BS)
    a, b = BlockTable("m"), BlockTable("m")
    for t in (a, b):  # both compute the same prompt at once, before either is cached
        bm.allocate(t, 2)
    bm.cache_full_blocks(a, prompt(8), 8)
    bm.cache_full_blocks(b, prompt(8), 8)
    assert bm.stats().cached == 2
    hit = BlockTable("m")
    bm.match_prefix(hit, prompt(9))
    assert hit.block_ids == a.block_ids
    bm.free(b)
    assert all(bm.blocks[x].hash is None for x in b.block_ids)


def test_counters_and_disabled_caching() -> None:
    bm = BlockManager(16, BS)
    computed(bm, prompt(8))
    t = BlockTable("m")
    hit = bm.match_prefix(t, prompt(9))
    bm.record_lookup(9, hit)
    s = bm.stats()
    assert (s.prefix_queried_tokens, s.prefix_hit_tokens) == (9, 8)
    assert s.prefix_hit_rate == pytest.approx(8 / 9)
    off = BlockManager(16, BS, enable_prefix_caching=False)
    computed(off, prompt(8))
    assert off.stats().cached == 0 and off.match_prefix(BlockTable("m"), prompt(9)) == 0
