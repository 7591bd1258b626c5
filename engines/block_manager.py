"""Paged KV memory: fixed-size blocks, block tables, reference counts and automatic prefix caching.

The block manager only does bookkeeping; the tensors live in `engines.kv.cache.PagedKVCache`. A block
holds `block_size` consecutive tokens of one sequence. Every full block gets a hash chained from its
parent block's hash, its token ids and a salt (the model, and the tenant when tenants are isolated),
so two sequences with the same prefix share the same blocks and compute them once.

Free blocks sit in one queue in LRU order: blocks without a hash at the front (nothing to lose), then
cached blocks from least to most recently released. Allocation takes from the front and evicts the
cached block it takes; a cache hit on a free block pulls it out of the queue. All of it is O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engines.kv.budget import KVBudget

BlockHash = int


def block_hash(parent: BlockHash | None, token_ids: tuple[int, ...], salt: str) -> BlockHash:
    """The hash of a full block: chained through its parent so equal blocks at different places differ."""
    return hash((parent, salt, token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: BlockHash | None = None  # set while the block is in the prefix cache
    token_ids: tuple[int, ...] = ()  # kept with the hash: a lookup compares them (collision guard)


@dataclass
class BlockTable:
    """One sequence's blocks, in order, and the hashes of its full blocks so far."""

    salt: str
    block_ids: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # one per full block, chained
    # Leading blocks given back while the sequence runs (a sliding window passed them): their ids stay in
    # `block_ids` as place holders that no attention reads, and `free` skips them.
    released: int = 0

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class BlockStats:
    num_blocks: int
    used: int  # referenced by at least one sequence
    free: int  # not referenced (cached or empty)
    cached: int  # in the prefix cache, referenced or not
    prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # of those, found computed
    evictions: int  # cached blocks reused for other data

    @property
    def utilization(self) -> float:
        return self.used / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        budget: KVBudget | None = None,
        block_bytes: int = 0,
        owner: str = "",
    ) -> None:
        """`budget`: a KV budget shared with other engines; each block in use charges `block_bytes`."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one block of at least one token")
        self.budget, self.block_bytes, self.owner = budget, block_bytes, owner
        if budget is not None:
            budget.register(owner)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._queried = self._hits = self._evictions = 0
        self._used_before = [False] * num_blocks
        self.first_use: list[int] = []  # blocks handed out for the first time; the engine zeroes them

    # --- queries -----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """How many more blocks `table` needs to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(table))

    def can_allocate(self, n: int, *, optional: bool = False) -> bool:
        """Whether `n` more blocks can be had. `optional`: a refusal does not count as this engine
        waiting for memory (speculative positions, which it can do without)."""
        if n > len(self._free):
            return False
        return (
            self.budget is None or n == 0 or self.budget.has_room(self.owner, n * self.block_bytes, optional=optional)
        )

    def stats(self) -> BlockStats:
        free = len(self._free)
        return BlockStats(
            num_blocks=self.num_blocks,
            used=self.num_blocks - free,
            free=free,
            cached=len(self._cached),
            prefix_queried_tokens=self._queried,
            prefix_hit_tokens=self._hits,
            evictions=self._evictions,
        )

    # --- prefix cache ------------------------------------------------------------------------------

    def match_prefix(self, table: BlockTable, token_ids: Sequence[int]) -> int:
        """Attach the longest cached prefix of `token_ids` to an empty table; returns the tokens covered.

        At most `len(token_ids) - 1` tokens are matched: the last one must be computed for its logits.
        """
        if table.block_ids:
            raise ValueError("prefix matching starts from an empty block table")
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        parent: BlockHash | None = None
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            h = block_hash(parent, tokens, table.salt)
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break  # a miss, or a hash collision with other tokens: compute from here
            self._take(block_id)
            table.block_ids.append(block_id)
            table.hashes.append(h)
            parent = h
        return len(table.block_ids) * bs

    def record_lookup(self, num_tokens: int, hit_tokens: int) -> None:
        """Count a prefix lookup once its sequence is admitted (a retried admission is not a new query)."""
        self._queried += num_tokens
        self._hits += hit_tokens

    def cache_full_blocks(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Register every block that is now full and computed; call after each forward pass."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(table.hashes), min(num_computed // bs, len(table.block_ids))):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(table.hashes[-1] if table.hashes else None, tokens, table.salt)
            table.hashes.append(h)
            if h not in self._cached:  # else an equal block is cached already: keep that one
                block = self.blocks[table.block_ids[i]]
                block.hash, block.token_ids = h, tokens
                self._cached[h] = block.block_id

    # --- allocation --------------------------------------------------------------------------------

    def allocate(self, table: BlockTable, n: int) -> None:
        """Append `n` fresh blocks to `table` (check `can_allocate` first)."""
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, {len(self._free)} free")
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # the least recently used cached block makes room
                del self._cached[block.hash]
                block.hash, block.token_ids = None, ()
                self._evictions += 1
            block.ref_count = 1
            self._charge(1)
            table.block_ids.append(block_id)
            if not self._used_before[block_id]:
                self._used_before[block_id] = True
                self.first_use.append(block_id)

    def free(self, table: BlockTable) -> None:
        """Release a sequence's blocks; cached ones stay reusable until evicted."""
        # Tail blocks first: they are the least likely to be shared, so they are evicted first.
        for block_id in reversed(table.block_ids[table.released :]):
            self._release(block_id)
        table.block_ids.clear()
        table.hashes.clear()
        table.released = 0

    def release_before(self, table: BlockTable, num_blocks: int) -> None:
        """Give back the sequence's first `num_blocks` blocks, which nothing will read again (every layer's
        window has passed them). Their ids stay in the table as place holders; cached ones stay cached."""
        num_blocks = min(num_blocks, len(table.block_ids))
        for i in range(table.released, num_blocks):
            self._release(table.block_ids[i])
        table.released = max(table.released, num_blocks)

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Keep only the blocks that hold the first `num_tokens` tokens: a speculative step's
        rejected positions give their blocks back. Never cuts into a registered (full) block."""
        keep = -(-num_tokens // self.block_size)
        if keep < len(table.hashes):
            raise ValueError("cannot truncate into blocks registered in the prefix cache")
        for block_id in reversed(table.block_ids[keep:]):
            self._release(block_id)  # never hashed: to the front of the free queue
        del table.block_ids[keep:]

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._charge(-1)
            self._free[block_id] = None
            if block.hash is None:
                self._free.move_to_end(block_id, last=False)  # empty: reuse before any cached block

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            self._charge(1)
        block.ref_count += 1

    def _charge(self, blocks: int) -> None:
        if self.budget is not None:
            if blocks > 0:
                self.budget.charge(self.owner, blocks * self.block_bytes)
            else:
                self.budget.release(self.owner, -blocks * self.block_bytes)
