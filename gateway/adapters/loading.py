"""An adapter's files onto the engine that serves it, once, before a request naming it is opened.

The engine keys adapters by `AdapterRecord.key` (tenant, tier, name and digest): two tenants' adapters of the same
name are two entries, a replaced adapter a new one, and the engine's prefix cache salts each request with the
adapter's digest (`engines.engine`). Loading reads and checks the files on a worker thread and attaches them
between two steps (`AsyncEngine.load_adapter`); concurrent requests for one adapter wait for one load. The engine
holds `engines.lora.DEFAULT_CAPACITY` adapters and makes room by dropping the least recently used idle one, so an
adapter dropped between this load and its request's arrival (eight other adapters loaded in that instant) is
loaded again by the next request that names it; the one in between is refused by the engine, never served by
another adapter.
"""

from __future__ import annotations

import asyncio
import contextlib

from engines.async_engine import AsyncEngine
from engines.protocol import RequestRejected
from gateway.adapters.store import AdapterRecord

__all__ = ["AdapterLoader"]


class AdapterLoader:
    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    async def ensure(self, engine: AsyncEngine, record: AdapterRecord) -> str:
        """The name `engine` serves `record` under, loading it first if it is not loaded (AdapterError: the
        files no longer check, or every adapter the engine holds is in use)."""
        key = record.key
        if key in engine.engine.adapters:
            return key
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in engine.engine.adapters:
                await engine.load_adapter(key, record.path)
        self._locks.pop(key, None)
        return key

    async def drop(self, engine: AsyncEngine, record: AdapterRecord) -> None:
        """Unload a deleted or replaced adapter where it is loaded and idle (in use: the LRU drops it later)."""
        if record.key in engine.engine.adapters:
            with contextlib.suppress(RequestRejected):  # running requests still use it; nothing names it any more
                await engine.unload_adapter(record.key)
