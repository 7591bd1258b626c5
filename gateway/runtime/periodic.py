"""A job run for ever on a period beside requests: the tuning and distill schedules' checks (`gateway.app`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio

__all__ = ["every"]

log = logging.getLogger(__name__)


async def every(seconds: float, job: Callable[[], Awaitable[object]], what: str) -> None:
    """`job()` each `seconds`, first after one period; a round that fails is logged as `what` and the next one tries
    again (the database may be down for a while)."""
    while True:
        await anyio.sleep(seconds)
        try:
            await job()
        except Exception:
            log.exception("%s failed", what)
