"""Atomic counters for budgets and rate limits: Redis when configured, else in-process.

A reservation adds several amounts at once, all or nothing: if any counter with a limit would pass
it, nothing is added and the caller learns which one refused. Settling adds the difference between
what was reserved and what was spent, once, and only while the reservation is still listed (a Redis
that restarted empty lost it, and its counters were loaded again from SQL without it). Reservations
stay listed until settled so a reconciliation can rebuild the counters from SQL plus what is still in
flight; `rebuild` writes them only if a version counter, which every reservation and settlement
bumps, shows that none happened since the caller read what it rebuilt from.

Money is counted in integer units of 1e-10 USD: Redis adds 64-bit integers exactly. The limit
comparison runs in Lua's doubles, exact below 2^53 units (~$900k) and off by far less than a cent
above that.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError


@dataclass(frozen=True)
class Item:
    key: str
    amount: int
    limit: int | None = None  # None: count, never refuse
    ttl: int = 3600  # seconds the counter lives after it is created
    seeded: bool = False  # must exist before use: missing means "load it from SQL first"


class Missing(Exception):
    """Counters that must be seeded from SQL before the reservation can be decided."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__(", ".join(keys))
        self.keys = keys


@dataclass(frozen=True)
class Refused:
    index: int  # which item
    current: int  # its counter's value


class Counters(Protocol):
    async def reserve(self, resv_id: str, items: list[Item]) -> Refused | None: ...

    async def settle(
        self, resv_id: str, deltas: list[tuple[str, int]], bump: str | None = None, bump_ttl: int = 3600
    ) -> bool: ...

    async def rebuild(self, version: str, seen: int | None, values: dict[str, tuple[int, int]]) -> bool: ...

    async def seed(self, key: str, value: int, ttl: int) -> None: ...

    async def get(self, key: str) -> int | None: ...

    async def put(self, key: str, value: int, ttl: int) -> None: ...

    async def outstanding(self) -> dict[str, list[tuple[str, int]]]: ...

    async def drop(self, resv_ids: list[str]) -> None: ...

    async def reservation_ages(self) -> dict[str, float]: ...

    async def close(self) -> None: ...


# A reservation already listed is not added again: the client resends a command whose connection broke
# (below), and the first send may have run. ARGV: reservations hash, reservation id, its record, then one
# JSON array of [amount, limit ('' for none), ttl, seeded ('1'/'0')] per KEYS, as strings (Lua's doubles
# would round large amounts). One packed argument instead of four per counter: building and parsing ~45
# arguments per request was the largest single cost of a cache hit in redis-py.
_RESERVE = """
if redis.call('HEXISTS', ARGV[1], ARGV[2]) == 1 then return {0} end
local n = #KEYS
local spec = cjson.decode(ARGV[4])
local missing = {}
for i = 1, n do
  if spec[i][4] == '1' and redis.call('EXISTS', KEYS[i]) == 0 then
    missing[#missing + 1] = KEYS[i]
  end
end
if #missing > 0 then return {-1, missing} end
for i = 1, n do
  local limit = spec[i][2]
  if limit ~= '' then
    local cur = tonumber(redis.call('GET', KEYS[i]) or '0')
    if cur + tonumber(spec[i][1]) > tonumber(limit) then return {i, tostring(cur)} end
  end
end
for i = 1, n do
  redis.call('INCRBY', KEYS[i], spec[i][1])
  redis.call('EXPIRE', KEYS[i], spec[i][3], 'NX')
end
redis.call('HSET', ARGV[1], ARGV[2], ARGV[3])
return {0}
"""

# ARGV: reservations hash, reservation id, key to bump ('' for none), its ttl, then a JSON array of one
# delta (a string) per KEYS.
_SETTLE = """
local held = redis.call('HDEL', ARGV[1], ARGV[2])
if held == 1 then
  local deltas = cjson.decode(ARGV[5])
  for i = 1, #KEYS do
    if deltas[i] ~= '0' and redis.call('EXISTS', KEYS[i]) == 1 then redis.call('INCRBY', KEYS[i], deltas[i]) end
  end
end
if ARGV[3] ~= '' then
  redis.call('INCR', ARGV[3])
  redis.call('EXPIRE', ARGV[3], ARGV[4], 'NX')
end
return held
"""

# KEYS[1]: the version counter, then the counters to write; ARGV: the version the caller saw ('' for
# none), then value and ttl per counter. Values stay strings: Lua's doubles would round large integers.
_REBUILD = """
if (redis.call('GET', KEYS[1]) or '') ~= ARGV[1] then return 0 end
for i = 2, #KEYS do
  redis.call('SET', KEYS[i], ARGV[2 * i - 2], 'EX', ARGV[2 * i - 1])
end
return 1
"""


def _record(items: list[Item]) -> str:
    return json.dumps({"t": time.time(), "items": [[i.key, i.amount] for i in items]})


class RedisCounters:
    def __init__(self, url: str, namespace: str = "sb", max_connections: int = 64) -> None:
        # A blocking pool: a burst of requests waits for a connection instead of failing with "Too many".
        # Bounded socket timeouts: a dead Redis must cost a request about a second, not minutes; the connect
        # timeout is not shorter because a burst opening the whole pool at once on a busy machine can take
        # a few hundred ms, and a timeout here fails budgeted requests closed (the caches use 0.25 s: a miss).
        # A command whose pooled connection is broken is sent once more on a new one: after Redis restarts,
        # every pooled socket is dead, and without the resend each would fail a budgeted request and start
        # a second of backing off (one per socket). Only ConnectionError: a timeout may mean it ran slowly.
        # Every script is safe to resend: reserve skips a listed reservation, settle deletes it first,
        # rebuild compares the version.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=30,
            decode_responses=True,
            socket_connect_timeout=1.0,
            socket_timeout=2.0,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self.redis = aioredis.Redis(connection_pool=pool)
        self.namespace = namespace
        self._reserve = self.redis.register_script(_RESERVE)
        self._settle = self.redis.register_script(_SETTLE)
        self._rebuild = self.redis.register_script(_REBUILD)

    @property
    def _resv_key(self) -> str:
        return f"{self.namespace}:reservations"

    async def reserve(self, resv_id: str, items: list[Item]) -> Refused | None:
        spec = [
            [str(it.amount), "" if it.limit is None else str(it.limit), str(it.ttl), "1" if it.seeded else "0"]
            for it in items
        ]
        args = [self._resv_key, resv_id, _record(items), json.dumps(spec)]
        result = await self._reserve(keys=[it.key for it in items], args=args)
        if result[0] == -1:
            raise Missing(list(result[1]))
        return None if result[0] == 0 else Refused(int(result[0]) - 1, int(result[1]))

    async def settle(
        self, resv_id: str, deltas: list[tuple[str, int]], bump: str | None = None, bump_ttl: int = 3600
    ) -> bool:
        """Add `deltas` if the reservation is still held; bump `bump` either way. True if it was held."""
        args = [self._resv_key, resv_id, bump or "", bump_ttl, json.dumps([str(d) for _, d in deltas])]
        return bool(await self._settle(keys=[k for k, _ in deltas], args=args))

    async def rebuild(self, version: str, seen: int | None, values: dict[str, tuple[int, int]]) -> bool:
        """Set each counter to its (value, ttl) if `version` still reads `seen`; False if it moved on."""
        args: list[str | int] = ["" if seen is None else str(seen)]
        for value, ttl in values.values():
            args += [str(value), ttl]
        return bool(await self._rebuild(keys=[version, *values], args=args))

    async def seed(self, key: str, value: int, ttl: int) -> None:
        await self.redis.set(key, value, ex=ttl, nx=True)

    async def get(self, key: str) -> int | None:
        value = await self.redis.get(key)
        return None if value is None else int(value)

    async def put(self, key: str, value: int, ttl: int) -> None:
        await self.redis.set(key, value, ex=ttl)

    async def outstanding(self) -> dict[str, list[tuple[str, int]]]:
        raw = await self.redis.hgetall(self._resv_key)
        return {rid: [(k, int(a)) for k, a in json.loads(v)["items"]] for rid, v in raw.items()}

    async def drop(self, resv_ids: list[str]) -> None:
        if resv_ids:
            await self.redis.hdel(self._resv_key, *resv_ids)

    async def reservation_ages(self) -> dict[str, float]:
        raw = await self.redis.hgetall(self._resv_key)
        now = time.time()
        return {rid: now - json.loads(v)["t"] for rid, v in raw.items()}

    async def close(self) -> None:
        await self.redis.aclose()


class LocalCounters:
    """The same semantics in one process, for a gateway started without Redis."""

    def __init__(self) -> None:
        self._values: dict[str, tuple[int, float]] = {}  # key → (value, expires at)
        self._reservations: dict[str, tuple[float, list[tuple[str, int]]]] = {}
        self._lock = threading.Lock()

    def _live(self, key: str, now: float) -> int | None:
        entry = self._values.get(key)
        if entry is None or entry[1] <= now:
            self._values.pop(key, None)
            return None
        return entry[0]

    async def reserve(self, resv_id: str, items: list[Item]) -> Refused | None:
        now = time.time()
        with self._lock:
            if resv_id in self._reservations:  # listed already: counted once (as the Redis script does)
                return None
            missing = [it.key for it in items if it.seeded and self._live(it.key, now) is None]
            if missing:
                raise Missing(missing)
            for i, it in enumerate(items):
                cur = self._live(it.key, now) or 0
                if it.limit is not None and cur + it.amount > it.limit:
                    return Refused(i, cur)
            for it in items:
                cur = self._live(it.key, now)
                expires = now + it.ttl if cur is None else self._values[it.key][1]
                self._values[it.key] = ((cur or 0) + it.amount, expires)
            self._reservations[resv_id] = (now, [(it.key, it.amount) for it in items])
        return None

    async def settle(
        self, resv_id: str, deltas: list[tuple[str, int]], bump: str | None = None, bump_ttl: int = 3600
    ) -> bool:
        now = time.time()
        with self._lock:
            held = self._reservations.pop(resv_id, None) is not None
            for key, delta in deltas if held else []:
                cur = self._live(key, now)
                if cur is not None and delta:
                    self._values[key] = (cur + delta, self._values[key][1])
            if bump is not None:
                cur = self._live(bump, now)
                self._values[bump] = ((cur or 0) + 1, now + bump_ttl if cur is None else self._values[bump][1])
        return held

    async def rebuild(self, version: str, seen: int | None, values: dict[str, tuple[int, int]]) -> bool:
        now = time.time()
        with self._lock:
            if self._live(version, now) != seen:
                return False
            for key, (value, ttl) in values.items():
                self._values[key] = (value, now + ttl)
        return True

    async def seed(self, key: str, value: int, ttl: int) -> None:
        with self._lock:
            if self._live(key, time.time()) is None:
                self._values[key] = (value, time.time() + ttl)

    async def get(self, key: str) -> int | None:
        with self._lock:
            return self._live(key, time.time())

    async def put(self, key: str, value: int, ttl: int) -> None:
        with self._lock:
            self._values[key] = (value, time.time() + ttl)

    async def outstanding(self) -> dict[str, list[tuple[str, int]]]:
        with self._lock:
            return {rid: list(items) for rid, (_, items) in self._reservations.items()}

    async def drop(self, resv_ids: list[str]) -> None:
        with self._lock:
            for rid in resv_ids:
                self._reservations.pop(rid, None)

    async def reservation_ages(self) -> dict[str, float]:
        now = time.time()
        with self._lock:
            return {rid: now - t for rid, (t, _) in self._reservations.items()}

    async def close(self) -> None:
        pass
