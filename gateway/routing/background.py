"""Runs after a response (shadow runs, explore runs): started on the event loop, counted per tenant while under
way (the warm-up shares count them as verdicts to come), and, at shutdown, let finish a while and then cancelled.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine
from typing import Any

__all__ = ["BackgroundRuns"]


class BackgroundRuns:
    """Tasks of the event loop's thread only."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._running: Counter[str] = Counter()  # tenant → runs under way

    def running(self, tenant: str) -> int:
        return self._running[tenant]

    @property
    def idle(self) -> bool:
        return not self._tasks

    def start(self, run: Coroutine[Any, Any, Any], tenant: str, name: str) -> None:
        """Start `run` in the background for `tenant`; it counts as under way until it ends, however it ends."""
        self._running[tenant] += 1
        task = asyncio.get_running_loop().create_task(run, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._ended(tenant))

    def _ended(self, tenant: str) -> None:
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]

    async def close(self, timeout: float = 30.0) -> None:
        """Let running runs finish (each writes its row), then cancel what is left."""
        tasks = list(self._tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
