"""HTTP plumbing for generations: server-sent events, and abort-on-disconnect for plain responses."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Send

T = TypeVar("T")


class EventStreamResponse(StreamingResponse):
    """SSE whose body iterator is always closed when the response ends, however it ends.

    Starlette cancels the sending task when the client disconnects, which can leave the iterator
    suspended at a `yield`; closing it runs its cleanup (engine abort, usage row) right away instead
    of whenever the garbage collector gets to it.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[str],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                if self.on_close is not None:  # e.g. give back what a never-started stream reserved
                    await self.on_close()


class ClientDisconnected(Exception):
    pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client hangs up first (then raise `ClientDisconnected`)."""
    result: list[T] = []

    async def run(scope: anyio.CancelScope) -> None:
        result.append(await work)
        scope.cancel()

    async def watch(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, tg.cancel_scope)
            tg.start_soon(watch, tg.cancel_scope)
    except BaseExceptionGroup as group:  # anyio wraps a task's error; callers want the error itself
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    if not result:
        raise ClientDisconnected
    return result[0]


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def typed_sse(payload: dict[str, Any]) -> str:
    """An event of a typed stream (the Responses and Messages APIs): its `type` as the SSE event name too."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"
