"""The exact response cache: a normalized request's key → the answer the engines gave it, per tenant.

Entries live in Redis as `{namespace}:cache:{tenant}:{key}` with the policy's TTL; a per-tenant sorted
set `{namespace}:cache-index:{tenant}`, scored by store time, caps each tenant at `max_entries` (the
oldest stored go first). The tenant is part of every key: two tenants never share an entry.

The cache never fails a request. A Redis error is a miss (get) or a skipped write (put), counted in
`errors` and logged at most every `LOG_EVERY` seconds. After a failure Redis is left alone for a backoff
(1 s doubling to 10 s) so that while it is down requests don't each wait on a connect; the first call
after the backoff tries again, and a success ends the outage. Without Redis (`redis_url=None`) an
in-process store gives the same semantics to a single gateway process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

log = logging.getLogger(__name__)


@dataclass
class CachedAnswer:
    texts: list[str]
    finish_reasons: list[str | None]
    prompt_tokens: int
    completion_tokens: int
    tier: str
    request_id: str  # the request that produced it
    created: int  # unix seconds

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, s: str | bytes) -> CachedAnswer:
        d = json.loads(s)
        answer = cls(
            texts=[str(t) for t in d["texts"]],
            finish_reasons=[None if r is None else str(r) for r in d["finish_reasons"]],
            prompt_tokens=int(d["prompt_tokens"]),
            completion_tokens=int(d["completion_tokens"]),
            tier=str(d["tier"]),
            request_id=str(d["request_id"]),
            created=int(d["created"]),
        )
        if len(answer.texts) != len(answer.finish_reasons):
            raise ValueError("texts and finish_reasons differ in length")
        return answer


# Store, index, drop index members older than the TTL (their entries have expired), then evict the
# oldest beyond the cap — in one script so concurrent puts can't overshoot the cap between steps.
# KEYS: entry, index. ARGV: value, ttl seconds, max entries, now (s), member, entry key prefix.
_PUT = """
local ttl = tonumber(ARGV[2])
local now = tonumber(ARGV[4])
redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
redis.call('ZADD', KEYS[2], now, ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. tostring(now - ttl))
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if excess > 0 then
  local old = redis.call('ZRANGE', KEYS[2], 0, excess - 1)
  for _, member in ipairs(old) do
    redis.call('DEL', ARGV[6] .. member)
  end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, excess - 1)
end
redis.call('EXPIRE', KEYS[2], ttl)
return excess
"""


class _LocalStore:
    """One process's cache: per tenant, entries in store order with their expiry (monotonic seconds)."""

    def __init__(self) -> None:
        self._tenants: dict[int, OrderedDict[str, tuple[float, str]]] = {}

    def get(self, tenant_id: int, key: str) -> str | None:
        entries = self._tenants.get(tenant_id, {})
        found = entries.get(key)
        if found is None:
            return None
        if found[0] <= time.monotonic():
            entries.pop(key, None)
            return None
        return found[1]

    def put(self, tenant_id: int, key: str, value: str, ttl: int, max_entries: int) -> None:
        entries = self._tenants.setdefault(tenant_id, OrderedDict())
        now = time.monotonic()
        entries.pop(key, None)  # a re-store counts as the newest
        entries[key] = (now + ttl, value)
        # Entries are in store order; with one TTL that is also expiry order, so expired ones are in front.
        while entries:
            first = next(iter(entries.values()))
            if first[0] > now and len(entries) <= max_entries:
                break
            entries.popitem(last=False)


class ResponseCache:
    BACKOFF_MIN = 1.0
    BACKOFF_MAX = 10.0
    LOG_EVERY = 30.0  # seconds between warnings while Redis keeps failing
    REBUILD_AFTER = 3  # consecutive failed attempts after which the client and its pool are rebuilt

    def __init__(self, redis_url: str | None, namespace: str = "sb") -> None:
        self.redis_url = redis_url
        self.namespace = namespace
        self.errors = 0
        self._local = _LocalStore() if redis_url is None else None
        self._redis: aioredis.Redis | None = None
        self._put_script: Any = None
        self._down_until = 0.0
        self._backoff = 0.0  # 0 while Redis answers
        self._failures = 0  # consecutive failed attempts
        self._last_log = float("-inf")
        self._unlogged = 0

    # --- state ---------------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._backoff == 0.0

    def _client(self) -> aioredis.Redis:
        # Built on first use, inside the running event loop the gateway serves from.
        if self._redis is None:
            assert self.redis_url is not None
            # A blocking pool makes a burst wait briefly for a connection instead of failing; short
            # timeouts keep a dead Redis to a fraction of a second per call. One immediate retry, on a
            # broken connection only: pooled connections die with a restarted Redis, and each would
            # otherwise cost a miss and a backoff; a timeout is not retried (a frozen Redis stays cheap).
            pool = aioredis.BlockingConnectionPool.from_url(
                self.redis_url,
                max_connections=64,
                timeout=0.5,
                decode_responses=True,
                socket_connect_timeout=0.25,
                socket_timeout=0.5,
                retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            )
            self._redis = aioredis.Redis.from_pool(pool)  # the client owns the pool: closing it closes both
            self._put_script = self._redis.register_script(_PUT)
        return self._redis

    def _skip(self) -> bool:
        return self._backoff > 0.0 and time.monotonic() < self._down_until

    async def _failed(self, op: str, exc: BaseException) -> None:
        self.errors += 1
        now = time.monotonic()
        if now < self._down_until:
            # Calls that were in flight when Redis went away: one outage, not a reason to back off longer.
            self._unlogged += 1
            return
        self._failures += 1
        self._backoff = min(self.BACKOFF_MAX, max(self.BACKOFF_MIN, self._backoff * 2))
        self._down_until = now + self._backoff
        if now - self._last_log >= self.LOG_EVERY:
            more = f" ({self._unlogged} more failures since the last warning)" if self._unlogged else ""
            log.warning(
                "response cache: Redis %s failed: %s: %s; serving misses, retrying in %.0f s%s",
                op,
                type(exc).__name__,
                exc,
                self._backoff,
                more,
            )
            self._last_log, self._unlogged = now, 0
        else:
            self._unlogged += 1
        if self._failures >= self.REBUILD_AFTER and self._redis is not None:
            # A pool can be left holding connections that will never work (or never come back); a fresh
            # client after repeated failures guarantees the next attempt starts clean.
            old, self._redis, self._put_script = self._redis, None, None
            with contextlib.suppress(Exception):  # closing a broken client may fail too; it is dropped anyway
                await old.aclose()

    def _succeeded(self) -> None:
        if self._backoff:
            log.warning("response cache: Redis answers again after %d failed attempts", self._failures)
        self._backoff = 0.0
        self._failures = 0

    # --- the interface -------------------------------------------------------------------------------

    def _entry_key(self, tenant_id: int, key: str) -> str:
        return f"{self.namespace}:cache:{tenant_id}:{key}"

    def _index_key(self, tenant_id: int) -> str:
        return f"{self.namespace}:cache-index:{tenant_id}"

    async def get(self, tenant_id: int, key: str) -> CachedAnswer | None:
        if self._local is not None:
            raw = self._local.get(tenant_id, key)
        else:
            if self._skip():
                return None
            try:
                raw = await self._client().get(self._entry_key(tenant_id, key))
            except Exception as exc:  # any Redis failure is a miss, never an error for the request
                await self._failed("get", exc)
                return None
            self._succeeded()
        if raw is None:
            return None
        try:
            return CachedAnswer.from_json(raw)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("response cache: unreadable entry %s for tenant %d: %s", key, tenant_id, exc)
            return None

    async def put(self, tenant_id: int, key: str, answer: CachedAnswer, ttl: int, max_entries: int) -> None:
        if max_entries <= 0 or ttl <= 0:
            return
        value = answer.to_json()
        if self._local is not None:
            self._local.put(tenant_id, key, value, ttl, max_entries)
            return
        if self._skip():
            return
        try:
            self._client()
            await self._put_script(
                keys=[self._entry_key(tenant_id, key), self._index_key(tenant_id)],
                args=[value, ttl, max_entries, time.time(), key, self._entry_key(tenant_id, "")],
            )
        except Exception as exc:  # a write that fails is a write skipped
            await self._failed("put", exc)
            return
        self._succeeded()

    async def close(self) -> None:
        if self._redis is not None:
            client, self._redis, self._put_script = self._redis, None, None
            try:
                await client.aclose()
            except Exception as exc:
                log.warning("response cache: closing Redis failed: %s", exc)
