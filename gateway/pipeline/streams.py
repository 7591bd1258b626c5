"""What a run reads and waits on: an engine stream whose first output was read already (`Primed`: `begin`
had to know the tier answers), a cached answer replayed as deltas, and `Watch`, which awaits work on the
request's behalf and cancels it if the client leaves."""

from __future__ import annotations

from collections.abc import Awaitable, Iterator
from typing import Protocol, TypeVar

from engines.protocol import OutputStream
from engines.request import FinishReason, RequestOutput
from gateway.cache.exact import CachedAnswer
from gateway.pipeline.choices import ChoiceDelta

__all__ = ["REPLAY_CHARS", "Primed", "Watch", "failed_before_output", "replay_pieces"]

T = TypeVar("T")

REPLAY_CHARS = 24  # a cached answer streams in pieces of about this many characters, like a generation


class Watch(Protocol):
    """Awaits work on the request's behalf, cancelling it if the client leaves (`gateway.http.streaming`)."""

    def __call__(self, work: Awaitable[T], /) -> Awaitable[T]: ...


def replay_pieces(answer: CachedAnswer) -> Iterator[ChoiceDelta]:
    """A cached answer as the deltas a generation would have sent."""
    for i, (text, reason) in enumerate(zip(answer.texts, answer.finish_reasons, strict=True)):
        pieces = [text[j : j + REPLAY_CHARS] for j in range(0, len(text), REPLAY_CHARS)] or [""]
        for j, piece in enumerate(pieces):
            yield ChoiceDelta(i, piece, reason if j == len(pieces) - 1 else None)


class Primed:
    """A stream whose first output `begin` already read (to know the tier answers); it is delivered first."""

    def __init__(self, stream: OutputStream, first: RequestOutput) -> None:
        self._stream = stream
        self._first: RequestOutput | None = first

    @property
    def last(self) -> dict[str, RequestOutput]:
        return self._stream.last

    def __aiter__(self) -> Primed:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._stream)

    async def aclose(self) -> None:
        await self._stream.aclose()


def failed_before_output(out: RequestOutput) -> bool:
    """A tier that failed before it produced anything: the next candidate may take the request."""
    return out.finish_reason is FinishReason.ERROR and out.completion_tokens == 0
