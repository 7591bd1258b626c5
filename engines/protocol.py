"""What the gateway needs of a tier's engine, in-process (`AsyncEngine`) or remote (`RemoteEngine`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from engines.request import EngineRequest, RequestOutput
from engines.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engines.structured import GrammarCompiler


class EngineUnavailable(RuntimeError):
    """The engine takes no requests now (stopped, dead, or its remote unreachable). Raised by `open`, or by
    the stream's first `__anext__` for an engine that only finds out on the way (a remote)."""


class OutputStream(Protocol):
    """The outputs of a group of requests; leaving early means `aclose()`, which aborts what is unfinished."""

    last: dict[str, RequestOutput]  # each request's latest output: its token counts so far, or final

    def __aiter__(self) -> OutputStream: ...

    async def __anext__(self) -> RequestOutput: ...

    async def aclose(self) -> None: ...


class Stats(Protocol):
    def as_dict(self) -> Mapping[str, Any]: ...


class TierEngine(Protocol):
    name: str

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    @property
    def grammars(self) -> GrammarCompiler | None:
        """Structured-output grammars for this engine's vocabulary; None if it cannot constrain its output."""

    def check(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        """Raise `RequestRejected` if the request cannot be served as asked."""

    def open(self, requests: list[EngineRequest]) -> OutputStream: ...

    def stats(self) -> Stats: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...
