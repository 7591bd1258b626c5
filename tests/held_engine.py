"""An engine whose next generation a test holds, or fails: who arrives while a request generates, and when
its engine errs, is decided by the test, never by timing."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from engines.async_engine import AsyncEngine
from engines.request import EngineRequest, FinishReason, RequestOutput


@dataclass
class Gate:
    after: int  # outputs that pass before the stream is held
    fail: bool  # once opened, the stream's next output is an engine error
    opened: threading.Event = field(default_factory=threading.Event)


class HeldStream:
    def __init__(self, stream: Any, gate: Gate) -> None:
        self._stream, self._gate, self._passed = stream, gate, 0

    @property
    def last(self) -> dict[str, RequestOutput]:
        return self._stream.last

    def __aiter__(self) -> HeldStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._passed >= self._gate.after:
            while not self._gate.opened.is_set():  # cancellable: a client that leaves is noticed meanwhile
                await asyncio.sleep(0.01)
        out = await anext(self._stream)
        self._passed += 1
        if self._passed > self._gate.after and self._gate.fail:
            return replace(out, finish_reason=FinishReason.ERROR, error="injected failure")
        return out

    async def aclose(self) -> None:
        await self._stream.aclose()


class HeldEngine:
    """The shared SmolLM2 engine, counting the generations it opens; `hold_next` holds the next one it opens
    after a few outputs until the gate opens."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self.opened = 0
        self._armed: Gate | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def hold_next(self, after: int = 2, fail: bool = False) -> Gate:
        self._armed = Gate(after, fail)
        return self._armed

    def open(self, requests: list[EngineRequest]) -> Any:
        self.opened += 1
        stream = self._engine.open(requests)
        gate, self._armed = self._armed, None
        return stream if gate is None else HeldStream(stream, gate)
