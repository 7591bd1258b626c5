"""The engine side of the KV tier (`engines.kv.tier`): restores a prompt's blocks on admission, writes a
long prompt's blocks after its prefill, and measures whether the tier pays (fetching a block against
computing it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engines.kv.cache import PagedKVCache
from engines.kv.tier import KVTier, KVTierStats
from engines.kv.tier_blocks import block_payload_bytes, chain_digests, snapshot_blocks, unpack_block, valid_payload

if TYPE_CHECKING:
    from engines.block_manager import BlockManager
    from engines.sequence import Sequence


class TierLink:
    """Binds a `KVTier` to one engine's pool and block manager: restores on admission, writes after
    prefill, and keeps the measurements that decide whether the tier pays."""

    def __init__(self, tier: KVTier, cache: PagedKVCache, block_manager: BlockManager, weights_format: str) -> None:
        """`weights_format`: the model's (`LlamaForCausalLM.weights_format`), part of the blocks' layout."""
        # What the tier's blocks must match besides the checkpoint: anything that changes the bytes.
        layers, _, kv_heads, _, block_size, head_dim = cache.buffer.shape
        kv_dtype = cache.buffer.dtype
        tier.attach(f"{weights_format}|{cache.dtype}|kv={kv_dtype}|bs={block_size}|{layers}x{kv_heads}x{head_dim}")
        self.tier, self.cache, self.bm = tier, cache, block_manager
        self.block_size = block_manager.block_size
        self.payload_bytes = block_payload_bytes(cache)
        self._fetch_s_per_byte: float | None = None  # running averages (EMA), None until measured
        self._prefill_s_per_token: float | None = None
        self._skips = 0

    @property
    def stats(self) -> KVTierStats:
        s = self.tier.stats
        s.fetch_us_per_block = round((self._fetch_s_per_byte or 0.0) * self.payload_bytes * 1e6, 1)
        s.prefill_us_per_block = round((self._prefill_s_per_token or 0.0) * self.block_size * 1e6, 1)
        return s

    def pays(self) -> bool:
        """Whether fetching a block is estimated faster than computing it (yes until both are measured;
        every 32nd refusal tries anyway, so a recovered network gets measured again)."""
        if self._fetch_s_per_byte is None or self._prefill_s_per_token is None:
            return True
        if self._fetch_s_per_byte * self.payload_bytes < self._prefill_s_per_token * self.block_size:
            return True
        self._skips += 1
        return self._skips % 32 == 0

    def observe_prefill(self, prompt_tokens: int, total_tokens: int, seconds: float) -> None:
        """One forward pass: counted if it was mostly prompt tokens (decode rows cost otherwise)."""
        if prompt_tokens >= 32 and prompt_tokens * 4 >= total_tokens * 3:
            self._prefill_s_per_token = _ema(self._prefill_s_per_token, seconds / total_tokens)

    def restore(self, seq: Sequence, hit: int) -> int:
        """Called on admission after the local prefix match (`hit` tokens): fetch the blocks that follow,
        copy the leading run of hits into the pool and register them. Returns the tokens now computed."""
        bs, table = self.block_size, seq.block_table
        full = (len(seq.token_ids) - 1) // bs  # the last token is always computed, for its logits
        start = len(table.block_ids)
        if not self.bm.enable_prefix_caching or full - start < self.tier.min_blocks:
            return hit
        if not self.pays():
            self.tier.stats.skipped += 1
            return hit
        started = time.perf_counter()
        digests = chain_digests(seq.token_ids, table.salt, bs, full)[start:]
        payloads = self.tier.fetch(digests)
        run = 0
        for digest, payload in zip(digests, payloads, strict=True):
            if not valid_payload(self.cache, payload, digest):
                if payload is not None:  # present but truncated or corrupt: count it, and clear it away
                    with self.tier._lock:
                        self.tier.stats.errors += 1
                    self.tier.drop([digest])
                break
            run += 1
        stats = self.tier.stats
        stats.lookups += 1
        if run and not self.bm.can_allocate(run):
            run = 0  # no room: compute as usual (the scheduler waits for memory on its own terms)
        stats.miss_blocks += len(digests) - run
        if not run:
            return hit
        self.bm.allocate(table, run)
        restored = table.block_ids[start:]
        for block_id, payload in zip(restored, payloads, strict=False):
            unpack_block(self.cache, block_id, payload)  # type: ignore[arg-type]
        # Fully written: the engine must not zero them before the step as it does fresh blocks.
        fresh = set(restored)
        self.bm.first_use[:] = [b for b in self.bm.first_use if b not in fresh]
        self.bm.cache_full_blocks(table, seq.token_ids, (start + run) * bs)
        nbytes = run * self.payload_bytes
        stats.hit_blocks += run
        stats.bytes_read += nbytes
        self._fetch_s_per_byte = _ema(self._fetch_s_per_byte, (time.perf_counter() - started) / nbytes)
        self.tier.touch(digests[:run])
        return (start + run) * bs

    def offload(self, seq: Sequence) -> None:
        """Called once a prompt's prefill has completed: queue its full blocks for Redis if the prompt is
        long and they are not known to be there. The copy is taken now; encoding and I/O are not here."""
        bs, table = self.block_size, seq.block_table
        full = min(seq.prompt_len // bs, len(table.hashes))
        if full < self.tier.min_blocks or not self._pays_now():
            return
        digests = chain_digests(seq.token_ids, table.salt, bs, full)
        todo = self.tier.unwritten(digests)
        if not todo:
            return
        kv, scales = snapshot_blocks(self.cache, [table.block_ids[i] for i in todo])
        self.tier.write_async([digests[i] for i in todo], kv, scales)

    def _pays_now(self) -> bool:
        """`pays` without counting a refusal: writes follow reads' verdict."""
        if self._fetch_s_per_byte is None or self._prefill_s_per_token is None:
            return True
        return self._fetch_s_per_byte * self.payload_bytes < self._prefill_s_per_token * self.block_size


def _ema(old: float | None, new: float, alpha: float = 0.2) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new
