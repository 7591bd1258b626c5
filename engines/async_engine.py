"""Runs an `Engine`'s step loop on its own thread and streams outputs to asyncio callers.

The event loop never waits on the model: callers put requests and aborts into an inbox, the engine
thread drains it between steps, and each step's outputs are handed back with `call_soon_threadsafe`.
Torch releases the GIL inside its kernels, so HTTP keeps flowing while a step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from engines.engine import Engine, EngineStats
from engines.lora.adapter import load_adapter
from engines.protocol import EngineUnavailable  # raised by `open` when the loop is stopped or has died
from engines.request import EngineRequest, FinishReason, RequestOutput
from engines.sampling import SamplingParams
from engines.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engines.structured import GrammarCompiler

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class _Call:
    """Work for the engine's thread between two steps (loading an adapter), and where its result goes."""

    call: Callable[[], Any]
    done: Future[Any]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


class AsyncEngine:
    def __init__(self, engine: Engine, *, name: str = "engine", threads: int | None = None) -> None:
        self.engine = engine
        self.name = name
        self.threads = threads
        self._cond = threading.Condition()
        self._inbox: list[EngineRequest | str | _Call] = []  # a request to add, the id of one to abort, or a call
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def grammars(self) -> GrammarCompiler:
        return self.engine.grammars

    def check(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        """Raise `RequestRejected` now, before streaming starts, if the request cannot be served.

        `open` does not repeat this: a request that skipped it and fails the engine's own check on
        the engine thread ends with an ERROR output saying why.
        """
        self.engine.check(prompt_token_ids, max_tokens)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (read from another thread: each field is current)."""
        return self.engine.stats()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; leaving early (break, cancel, error) aborts it."""
        async with self.open([request]) as outputs:
            async for out in outputs:
                yield out

    async def hidden_state(self, prompt_token_ids: list[int], layer: int, cache_salt: str = "") -> torch.Tensor:
        """A prompt's last-token hidden state after `layer` layers, from a prefill-only request run in this
        engine's batches; the prompt's blocks stay in the prefix cache under `cache_salt`. RuntimeError
        if the engine could not compute it (rejected, failed, stopped)."""
        request = EngineRequest(
            f"hidden-{uuid.uuid4().hex}", prompt_token_ids, SamplingParams(max_tokens=1),
            cache_salt=cache_salt, hidden_layer=layer,
        )  # fmt: skip
        last = None
        async for out in self.generate(request):
            last = out
        if last is None or last.hidden is None:
            why = "no output" if last is None else (last.error or str(last.finish_reason))
            raise RuntimeError(f"engine {self.name}: no hidden state ({why})")
        return last.hidden

    def open(self, requests: list[EngineRequest]) -> RequestStream:
        """Submit requests and stream their outputs together (one queue for all, no task per choice).

        Use as `async with engine.open(reqs) as stream: async for out in stream`; leaving the block
        early aborts what has not finished and waits for the engine's word, so `stream.last` holds
        every request's final token count.
        """
        stream = RequestStream(self, requests)
        with self._cond:
            if self._stopping or not self.alive:
                raise EngineUnavailable(f"engine {self.name} is not running")
            if clash := stream.pending & self._streams.keys():
                raise ValueError(f"request ids already streaming: {sorted(clash)}")
            for request in requests:
                self._streams[request.request_id] = stream._listener
                self._inbox.append(request)
            self._cond.notify()
        return stream

    async def load_adapter(self, name: str, path: str | Path) -> None:
        """Serve the PEFT adapter at `path` as `name`: read and checked on a worker thread (AdapterError if it cannot
        be served), then attached on the engine's thread between two steps, so no forward sees it half loaded."""
        adapter = await asyncio.to_thread(load_adapter, path, self.engine.model)
        await self._between_steps(lambda: self.engine.load_adapter(name, adapter))

    async def unload_adapter(self, name: str) -> bool:
        """Stop serving `name`, between two steps (RequestRejected while a running request uses it)."""
        return await self._between_steps(lambda: self.engine.unload_adapter(name))

    async def _between_steps(self, call: Callable[[], T]) -> T:
        """`call`'s result, run on the engine's thread between steps (here, if the thread is not running)."""
        if not self.alive:
            return call()
        done: Future[T] = Future()
        with self._cond:
            self._inbox.append(_Call(call, done))  # type: ignore[arg-type]
            self._cond.notify()
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._inbox.append(request_id)
            self._cond.notify()

    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # per thread with OpenMP: this one runs the model
        while True:
            with self._cond:
                while not (self._inbox or self._stopping or self.engine.has_unfinished()):
                    self._cond.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
            for item in inbox:
                self._apply(item)
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a bug or OOM must fail the requests, not kill the thread
                    log.exception("engine %s step failed", self.name)
                    outputs = self._fail_all(f"engine step failed: {exc}")
                for out in outputs:
                    self._deliver(out)
        # Stopping: whatever is still waiting or running ends as aborted, so no caller waits forever.
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, EngineRequest):
                self._deliver(_final_output(item, FinishReason.ABORT))
            elif isinstance(item, _Call):
                item.done.set_exception(EngineUnavailable(f"engine {self.name} stopped"))
        for rid in list(self._streams):
            self._apply(rid)

    def _apply(self, item: EngineRequest | str | _Call) -> None:
        if isinstance(item, _Call):
            try:
                item.done.set_result(item.call())
            except Exception as exc:
                item.done.set_exception(exc)
            return
        if isinstance(item, str):
            out = self.engine.abort(item)
            if out is not None:
                self._deliver(out)
            else:  # not running: finished already, or rejected; drop any listener left
                self._streams.pop(item, None)
            return
        try:
            self.engine.add_request(item)
        except Exception as exc:
            self._deliver(_final_output(item, FinishReason.ERROR, str(exc)))

    def _fail_all(self, message: str) -> list[RequestOutput]:
        outs = []
        for rid in list(self._streams):
            if (out := self.engine.abort(rid)) is not None:
                outs.append(replace(out, finish_reason=FinishReason.ERROR, error=message))
        return outs

    def _deliver(self, out: RequestOutput) -> None:
        with self._cond:
            stream = self._streams.get(out.request_id)
            if stream is not None and out.finished:
                del self._streams[out.request_id]
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
            except RuntimeError:  # the caller's event loop is gone; nobody is listening
                log.debug("dropping output for %s: event loop closed", out.request_id)


class RequestStream:
    """The outputs of a group of requests, in the order the engine produced them."""

    def __init__(self, engine: AsyncEngine, requests: list[EngineRequest]) -> None:
        self._engine = engine
        self._listener = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self.pending = {r.request_id for r in requests}
        self.last: dict[str, RequestOutput] = {}  # the latest output of each request

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.pending:
            raise StopAsyncIteration
        out = await self._listener.queue.get()
        self.last[out.request_id] = out
        if out.finished:
            self.pending.discard(out.request_id)
        return out

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self, timeout: float = 30.0) -> None:
        """Abort what is unfinished and collect the engine's final outputs (bounded by `timeout`).

        The engine answers an abort within one step. A caller that is being cancelled and needs the
        final counts (for billing) must shield this call from its cancellation.
        """
        if not self.pending:
            return
        for request_id in self.pending:
            self._engine.abort(request_id)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drain(), timeout)

    async def _drain(self) -> None:
        while self.pending:
            await self.__anext__()


def _final_output(request: EngineRequest, reason: FinishReason, error: str | None = None) -> RequestOutput:
    """The last word on a request that never ran."""
    return RequestOutput(request.request_id, [], "", len(request.prompt_token_ids), 0, reason, error)
