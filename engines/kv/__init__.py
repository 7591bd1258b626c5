"""The KV cache's memory: the paged pool every attention backend reads and writes (`cache`), a byte budget
several engines' pools share (`budget`), and the Redis prefix tier that shares long prompts' blocks across
replicas and restarts (`tier`, the Redis side; `tier_blocks`, digests and payloads; `tier_link`, the engine
side). Which blocks a sequence holds is `engines.block_manager`'s business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines import lazy_exports

if TYPE_CHECKING:
    from engines.kv.budget import KVBudget
    from engines.kv.cache import PagedKVCache, bytes_per_block, bytes_per_token
    from engines.kv.tier import KVTier, KVTierStats, checkpoint_fingerprint
    from engines.kv.tier_blocks import chain_digests
    from engines.kv.tier_link import TierLink

__all__ = [
    "KVBudget",
    "KVTier",
    "KVTierStats",
    "PagedKVCache",
    "TierLink",
    "bytes_per_block",
    "bytes_per_token",
    "chain_digests",
    "checkpoint_fingerprint",
]

_EXPORTS = {
    "KVBudget": "budget",
    "PagedKVCache": "cache",
    "bytes_per_block": "cache",
    "bytes_per_token": "cache",
    "KVTier": "tier",
    "KVTierStats": "tier",
    "checkpoint_fingerprint": "tier",
    "chain_digests": "tier_blocks",
    "TierLink": "tier_link",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
