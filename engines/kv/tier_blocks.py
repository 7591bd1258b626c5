"""What the KV tier (`engines.kv.tier`) stores per block: a stable digest of the block's tokens, chained
through its parent's (and the prefix-cache salt), and a payload of every layer's keys and values (and int8
scales) as raw bytes behind a 28-byte header (magic, version, crc32, the block's digest).

The block manager's own hash is Python's `hash()`, which is salted per process, so the tier chains its
own blake2b digests.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
import zlib
from collections.abc import Sequence as Seq

import torch

from engines.kv.cache import PagedKVCache

LAYOUT_VERSION = 1
_MAGIC = b"SBKV"
_HEADER = struct.Struct("<4sB3xI16s")  # magic, layout version, crc32 of the body, the block's digest
DIGEST_SIZE = 16


def chain_digests(token_ids: Seq[int], salt: str, block_size: int, num_blocks: int) -> list[bytes]:
    """Stable digests of the first `num_blocks` full blocks, each chained through its parent's."""
    parent = hashlib.blake2b(salt.encode(), digest_size=DIGEST_SIZE).digest()
    out = []
    for i in range(num_blocks):
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
        h.update(struct.pack(f"<{len(tokens)}I", *tokens))  # fixed width and byte order: same everywhere
        parent = h.digest()
        out.append(parent)
    return out


def block_payload_bytes(cache: PagedKVCache) -> int:
    """Bytes of one block's payload: header, keys and values of every layer, scales if int8."""
    n = cache.buffer[:, :, :, 0].numel() * cache.buffer.element_size()
    if cache.scales is not None:
        n += cache.scales[:, :, :, 0].numel() * cache.scales.element_size()
    return _HEADER.size + n


def snapshot_blocks(cache: PagedKVCache, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A copy of these blocks, block-major: (n, layers, k|v, kv_heads, block_size, head_dim) and scales."""
    kv = torch.stack([cache.buffer[:, :, :, b] for b in block_ids])
    scales = None if cache.scales is None else torch.stack([cache.scales[:, :, :, b] for b in block_ids])
    return kv, scales


def encode_block(digest: bytes, kv: torch.Tensor, scales: torch.Tensor | None) -> bytes:
    """One block's payload from its snapshot (`kv[i]`, `scales[i]` of `snapshot_blocks`)."""
    parts = [kv.contiguous().view(torch.uint8).numpy()]
    if scales is not None:
        parts.append(scales.contiguous().view(torch.uint8).numpy())
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return b"".join([_HEADER.pack(_MAGIC, LAYOUT_VERSION, crc, digest), *parts])


def pack_block(cache: PagedKVCache, block_id: int, digest: bytes) -> bytes:
    kv, scales = snapshot_blocks(cache, [block_id])
    return encode_block(digest, kv[0], None if scales is None else scales[0])


def valid_payload(cache: PagedKVCache, payload: bytes | None, digest: bytes) -> bool:
    """Whether `payload` is this block's, whole, in this layout (a short, stale or foreign value is a miss)."""
    if payload is None or len(payload) != block_payload_bytes(cache):
        return False
    magic, version, crc, stored = _HEADER.unpack_from(payload)
    body = memoryview(payload)[_HEADER.size :]
    return magic == _MAGIC and version == LAYOUT_VERSION and stored == digest and zlib.crc32(body) == crc


def unpack_block(cache: PagedKVCache, block_id: int, payload: bytes) -> None:
    """Copy a valid payload (see `valid_payload`) into `block_id` of the pool: every layer, every slot."""
    block = cache.buffer[:, :, :, block_id]
    n = block.numel() * block.element_size()
    with warnings.catch_warnings():  # read-only bytes: we copy out of them at once, never write
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=_HEADER.size)
        block.copy_(src.view(cache.buffer.dtype).view(block.shape))
        if cache.scales is not None:
            scales = cache.scales[:, :, :, block_id]
            m = scales.numel() * scales.element_size()
            src = torch.frombuffer(payload, dtype=torch.uint8, count=m, offset=_HEADER.size + n)
            scales.copy_(src.view(cache.scales.dtype).view(scales.shape))
