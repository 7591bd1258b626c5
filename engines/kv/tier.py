"""A KV prefix tier in Redis: full blocks of long prompt prefixes, shared by replicas and restarts.

When a prompt's prefill completes, the full blocks of a long prompt (≥ `min_blocks`) are written to
Redis, keyed by a stable chained digest of their tokens (and the prefix-cache salt, so tenants stay
apart) under a fingerprint of the checkpoint and KV layout: KV from another model, dtype, KV dtype or
block size is never read. On admission, after the local prefix cache, the engine fetches the blocks
that follow the local hit, copies the leading run of hits into its pool, registers them in its prefix
cache and starts the prefill after them, exactly as if it had computed them.

Digests and payloads: `engines.kv.tier_blocks`. This module is the Redis side (`KVTier`); the engine
side, restoring on admission and writing after prefill, is `engines.kv.tier_link.TierLink`.

It only pays where moving a block is faster than computing it. The engine measures both (seconds
per KV byte fetched and copied, seconds per prefill token) and skips the tier when fetching would be
slower; until both are measured it tries the tier. Faults never reach the engine step: Redis down is
a miss, counted, logged at most every 30 s, and Redis is left alone for a backoff of 1-30 s.

Measured with `bench/kv_tier.py` (CPU, OMP_NUM_THREADS=2, local Redis 7 over TCP, redis-py without
hiredis): a ~1,000-token system prompt (rules + JSON tool schemas) and a new question, fresh engine:

    model                          KV    blocks  bytes read  TTFT cold  TTFT tier  fetch+copy  speedup
    SmolLM2-135M bf16              bf16    63     23.2 MB     1.055 s    0.087 s    0.035 s     12x
    Qwen2.5-Coder-0.5B int8        bf16    63     12.4 MB     2.718 s    0.098 s    0.016 s     28x
    Qwen2.5-Coder-0.5B int8        int8    63      6.4 MB     2.855 s    0.092 s    0.009 s     31x

Per block: fetching, checking and copying costs 0.55 ms (369 KB) / 0.25 ms (197 KB) / 0.14 ms
(101 KB) against 16 / 42 / 44 ms to prefill its 16 tokens, so the tier pays down to a link of about
22 / 5 / 2.3 MB/s: on any LAN for these models. The writer's TTFT is the cold one within noise (the step
only snapshots the blocks; encoding and I/O run on the writer thread). Where it would not pay (a slow link,
or a fast accelerator prefill), the measured estimate switches reads and writes off.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engines.kv.tier_blocks import LAYOUT_VERSION, encode_block

log = logging.getLogger(__name__)

# For the writer thread: ("write", digests, block snapshots, scales), ("touch" | "drop", digests, None, None).
_Write = tuple[str, list[bytes], torch.Tensor | None, torch.Tensor | None]


def checkpoint_fingerprint(model_dir: str | Path, weights: str | None = None) -> str:
    """Identifies a checkpoint: its config, quantization record, and each weight file's size and first
    4 MiB / last 1 MiB (any fine-tune changes those bytes), plus how it is quantized on load. Cheap:
    reads a few MiB, not the weights."""
    model_dir = Path(model_dir)
    h = hashlib.blake2b(f"weights={weights}".encode(), digest_size=16)
    for name in ("config.json", "quantization.json"):
        path = model_dir / name
        if path.is_file():
            h.update(name.encode() + path.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(4 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read())
    return h.hexdigest()


@dataclass
class KVTierStats:
    lookups: int = 0  # admissions that asked Redis
    hit_blocks: int = 0  # blocks restored from Redis
    miss_blocks: int = 0  # blocks asked for and not restored (absent, invalid, or after the first miss)
    skipped: int = 0  # admissions that did not ask: fetching would be slower than computing
    bytes_read: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    dropped: int = 0  # blocks not written: the write queue was full
    errors: int = 0  # Redis failures and invalid payloads
    fetch_us_per_block: float = 0.0  # measured estimates the pays-or-not decision uses (0: none yet)
    prefill_us_per_block: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {f"kv_tier_{k}": v for k, v in asdict(self).items()}


class KVTier:
    """Blocks in Redis under one model fingerprint. Sync client: the engine step runs on its own thread;
    writes go through one background thread so a prefill never waits on the network."""

    def __init__(
        self,
        url: str,
        namespace: str = "sb",
        *,
        checkpoint: str,
        min_blocks: int = 4,
        ttl_s: int = 3600,
        max_queued_bytes: int = 128 << 20,
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if min_blocks < 1:
            raise ValueError("min_blocks must be at least 1")
        # Short timeouts and no retries: a dead Redis costs one admission a fraction of a second, then
        # the backoff keeps every later one off it.
        self.redis = redis.Redis.from_url(
            url, socket_connect_timeout=0.25, socket_timeout=2.0, retry=Retry(NoBackoff(), 0)
        )
        self.namespace, self.checkpoint = namespace, checkpoint
        self.min_blocks, self.ttl_s = min_blocks, ttl_s
        self.fingerprint = ""  # set by `attach`: the checkpoint and the engine's KV layout
        self.stats = KVTierStats()
        self._lock = threading.Lock()
        self._written: dict[bytes, float] = {}  # digest → when we wrote (or read) it
        self._down_until = 0.0
        self._backoff = 1.0
        self._last_warning = 0.0
        self._queue: queue.Queue[_Write | None] = queue.Queue()
        self._queued = 0  # bytes of snapshots waiting for the writer
        self._max_queued = max_queued_bytes
        self._writer: threading.Thread | None = None

    def attach(self, layout: str) -> None:
        """Bind to one engine's KV layout; keys of any other checkpoint or layout never meet these."""
        if self.fingerprint:
            raise ValueError("a KV tier serves one engine; make one per engine")
        ident = f"{self.checkpoint}|{layout}|v{LAYOUT_VERSION}"
        self.fingerprint = hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()

    def key(self, digest: bytes) -> str:
        return f"{self.namespace}:kv:{self.fingerprint}:{digest.hex()}"

    # --- reads (engine thread) ---------------------------------------------------------------------

    def fetch(self, digests: list[bytes]) -> list[bytes | None]:
        """Payloads by digest, None where absent; Redis down or failing reads as all absent."""
        if not digests or not self._up():
            return [None] * len(digests)
        try:
            pipe = self.redis.pipeline(transaction=False)
            for i in range(0, len(digests), 16):  # several replies of ≤ 16 blocks: no one giant reply
                pipe.mget([self.key(d) for d in digests[i : i + 16]])
            values = [v for chunk in pipe.execute() for v in chunk]
        except Exception as exc:  # never into the engine step
            self._failed("read", exc)
            return [None] * len(digests)
        self._ok()
        return values

    def touch(self, digests: list[bytes]) -> None:
        """Keep blocks just read alive another TTL (in the background); remember them as written."""
        self._remember(digests)
        self._put(("touch", digests, None, None))

    def drop(self, digests: list[bytes]) -> None:
        """Delete blocks whose stored value is not valid (in the background), so a writer replaces them:
        a writer only sends blocks that are absent."""
        with self._lock:
            for d in digests:
                self._written.pop(d, None)
        self._put(("drop", digests, None, None))

    # --- writes ------------------------------------------------------------------------------------

    def store(self, digest: bytes, payload: bytes, ttl: int | None = None) -> bool:
        """Write one payload now, synchronously (tests and tools; the engine queues `write_async`).
        False if Redis failed or is being left alone."""
        if not self._up():
            return False
        try:
            self.redis.set(self.key(digest), payload, ex=ttl or self.ttl_s)
        except Exception as exc:
            self._failed("write", exc)
            return False
        self._ok()
        return True

    def unwritten(self, digests: list[bytes]) -> list[int]:
        """Indices of the digests this process has not written or read within half a TTL."""
        stale = time.monotonic() - self.ttl_s / 2
        with self._lock:
            return [i for i, d in enumerate(digests) if d not in self._written or self._written[d] < stale]

    def write_async(self, digests: list[bytes], kv: torch.Tensor, scales: torch.Tensor | None) -> bool:
        """Queue snapshotted blocks for the writer; False (dropped) if too much is queued already."""
        if not self._up():
            return False
        size = _nbytes(kv, scales)
        with self._lock:
            # Bounded memory; a snapshot larger than the bound still goes when nothing else waits.
            if self._queued and self._queued + size > self._max_queued:
                self.stats.dropped += len(digests)
                return False
            self._queued += size
        self._remember(digests)  # so the next prompt with this prefix does not queue them again
        self._put(("write", digests, kv, scales))
        return True

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write is done (tests, and a process about to exit)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(5)
            self._writer = None
        self.redis.close()

    def _put(self, item: _Write) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
            self._writer.start()
        self._queue.put(item)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            except Exception as exc:  # the writer thread must outlive any one failure
                self._failed("write", exc)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, op: str, digests: list[bytes], kv: torch.Tensor | None, scales: torch.Tensor | None) -> None:
        keys = [self.key(d) for d in digests]
        written = False
        try:
            if not self._up():
                return
            if kv is None:  # a touch refreshes the TTL of blocks just read; a drop deletes bad ones
                pipe = self.redis.pipeline(transaction=False)
                for k in keys:
                    if op == "touch":
                        pipe.expire(k, self.ttl_s)
                    else:
                        pipe.delete(k)
                pipe.execute()
                self._ok()
                return
            # Another replica may have written them: ask first, and only send what is missing.
            pipe = self.redis.pipeline(transaction=False)
            for k in keys:
                pipe.expire(k, self.ttl_s)
            present = pipe.execute()
            pipe = self.redis.pipeline(transaction=False)
            sent = 0
            for i, (key, there) in enumerate(zip(keys, present, strict=True)):
                if not there:
                    payload = encode_block(digests[i], kv[i], None if scales is None else scales[i])
                    pipe.set(key, payload, ex=self.ttl_s)
                    sent += len(payload)
            pipe.execute()
            written = True
            self._ok()
            with self._lock:
                self.stats.blocks_written += sum(1 for there in present if not there)
                self.stats.bytes_written += sent
        except Exception as exc:
            self._failed("write", exc)
        finally:
            if kv is not None:
                with self._lock:
                    self._queued -= _nbytes(kv, scales)
                    if not written:  # let a later prompt try again
                        for d in digests:
                            self._written.pop(d, None)

    # --- health ------------------------------------------------------------------------------------

    def _remember(self, digests: list[bytes]) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._written) > 200_000:  # bounded: forgetting only costs a redundant EXPIRE
                self._written.clear()
            for d in digests:
                self._written[d] = now

    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _ok(self) -> None:
        self._backoff = 1.0

    def _failed(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            self.stats.errors += 1
            self._down_until = now + self._backoff
            self._backoff = min(self._backoff * 2, 30.0)
            warn = now - self._last_warning >= 30.0
            if warn:
                self._last_warning = now
        if warn:
            log.warning("KV tier %s failed (%s); serving without it for %.0f s", what, exc, self._down_until - now)


def _nbytes(kv: torch.Tensor, scales: torch.Tensor | None) -> int:
    return kv.numel() * kv.element_size() + (0 if scales is None else scales.numel() * scales.element_size())
