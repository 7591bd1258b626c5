"""A tier served by another OpenAI-compatible server: vLLM, SGLang, llama.cpp's server, another switchboard.

Prompts are tokenized here with the tier's own tokenizer, exactly as for an in-process tier, and each
engine request goes out as one streaming `POST {url}/v1/completions` whose `prompt` is the token ids (or,
for servers that take only text, such as llama-cpp-python's, those ids decoded back to their text);
the remote's text deltas come back as `RequestOutput`s as they arrive. Choices of one request (n > 1)
are separate calls running concurrently, merged into one stream.

Failures before a call's first token (connect errors and timeouts, dropped connections, HTTP 429, 502,
503, 504) are retried with exponential backoff and jitter; after it, never: the client has seen text.
A circuit breaker stops calling a remote that keeps failing, so the gateway falls back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np

from engines.protocol import EngineUnavailable, RequestRejected, check_context
from engines.remote.circuit_breaker import CircuitBreaker
from engines.request import EngineRequest, FinishReason, RequestOutput
from engines.tokenizer import Tokenizer

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 504})
# The remote refusing our credentials or model is our configuration's fault, not the request's.
CONFIG_STATUSES = frozenset({401, 403, 404})
REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ERROR}


@dataclass(frozen=True)
class RemoteConfig:
    url: str  # the server's root; calls go to {url}/v1/completions
    model: str  # the model name the remote serves
    embedding_model: str | None = None  # the model its /v1/embeddings serves; None: `model`
    api_key: str | None = None
    timeout_s: float = 600.0  # one call from start to last token, retries included
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0  # the longest silence between two chunks
    max_connections: int = 100
    max_retries: int = 2
    backoff_s: float = 0.1  # the first retry's delay; it doubles, with jitter
    max_backoff_s: float = 2.0
    max_retry_after_s: float = 5.0  # a longer `retry-after` is cut to this
    breaker_failures: int = 5
    breaker_cooldown_s: float = 30.0
    # How the prompt goes out: its token ids, or their text (special tokens spelled out) for a server
    # whose /v1/completions takes only strings; that server tokenizes it again, and we bill our own count.
    prompt_format: Literal["tokens", "text"] = "tokens"


@dataclass(frozen=True)
class RemoteStats:
    url: str
    model: str
    running: int  # calls in flight
    calls: int  # HTTP calls made, retries included
    retries: int
    failures: int  # calls that failed (each retry's failure counted)
    breaker: dict[str, str | int]

    def as_dict(self) -> dict[str, str | int]:
        return {
            "remote_url": self.url,
            "remote_model": self.model,
            "running": self.running,
            "remote_calls": self.calls,
            "remote_retries": self.retries,
            "remote_failures": self.failures,
            **self.breaker,
        }


class _Failure(Exception):
    """A call failed; `retry_after`: may be retried (before any token), after this many seconds (None: backoff)."""

    def __init__(self, message: str, *, retryable: bool, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after


@dataclass
class _Progress:
    """One call's progress, kept across its retries."""

    prompt_tokens: int
    completion_tokens: int = 0  # counted per chunk while streaming, then the server's own count
    cached_tokens: int = 0
    reason: FinishReason | None = None
    produced: bool = False  # a token arrived: no more retries
    answered: bool = False  # the remote answered this attempt: a verdict for the breaker


@dataclass(frozen=True)
class _Failed:
    """A choice that failed before producing anything; `error` is what the stream raises."""

    request_id: str
    error: Exception


class RemoteEngine:
    def __init__(
        self, tokenizer: Tokenizer, config: RemoteConfig, *, name: str, max_model_len: int, vocab_size: int
    ) -> None:
        self.name = name
        self.config = config
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        self._client: httpx.AsyncClient | None = None
        self._closing: asyncio.Task | None = None
        self._running = 0
        self._calls = self._retries = self._failures = 0

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, config: RemoteConfig, *, name: str, max_model_len: int | None
    ) -> RemoteEngine:
        """The tokenizer and context length of the model in `model_dir` (a HF directory; no weights are read)."""
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        tokenizer = Tokenizer(model_dir)
        context = cfg.get("max_position_embeddings") or max_model_len
        if context is None:
            raise ValueError(f"tier {name!r}: {model_dir} names no context length; set max_model_len")
        return cls(
            tokenizer,
            config,
            name=name,
            max_model_len=min(context, max_model_len or context),
            vocab_size=cfg.get("vocab_size") or len(tokenizer.hf),
        )

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def grammars(self) -> None:
        return None  # token masks need the sampler: a remote tier serves no structured output (yet)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def alive(self) -> bool:
        return self._client is not None and self.breaker.state != "open"

    def check(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        check_context(prompt_token_ids, max_tokens, self._max_model_len, vocab_size=self._vocab_size)

    def stats(self) -> RemoteStats:
        c = self.config
        return RemoteStats(
            c.url, c.model, self._running, self._calls, self._retries, self._failures, self.breaker.as_dict()
        )

    def start(self) -> None:
        if self._client is not None:
            return
        c = self.config
        self._client = httpx.AsyncClient(
            base_url=c.url.rstrip("/"),
            headers={"Authorization": f"Bearer {c.api_key}"} if c.api_key else None,
            # No pool timeout: a call waiting for a free connection is bounded by `timeout_s` instead.
            timeout=httpx.Timeout(c.read_timeout_s, connect=c.connect_timeout_s, pool=None),
            limits=httpx.Limits(max_connections=c.max_connections, max_keepalive_connections=c.max_connections),
        )

    def shutdown(self) -> None:
        """Stop taking calls; the pool closes on the running event loop (the app's, at its shutdown)."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(RuntimeError):  # no loop: the process's exit closes the sockets
                self._closing = asyncio.get_running_loop().create_task(client.aclose())

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def open(self, requests: list[EngineRequest]) -> RemoteStream:
        if self._client is None:
            raise EngineUnavailable(f"remote tier {self.name} is not started")
        return RemoteStream(self, requests)

    # --- one call ------------------------------------------------------------------------------------------

    async def call(self, request: EngineRequest, emit: Callable[[RequestOutput | _Failed], None]) -> None:
        """Run one request to its end, emitting its outputs; a failure before any output is emitted as `_Failed`."""
        progress = _Progress(len(request.prompt_token_ids))
        self._running += 1
        try:
            async with asyncio.timeout(self.config.timeout_s):
                await self._call_with_retries(request, progress, emit)
        except TimeoutError:
            self._fail(request, progress, emit, f"no answer within {self.config.timeout_s} s")
        except RequestRejected as exc:
            emit(_Failed(request.request_id, exc))
        except _Failure as exc:
            self._fail(request, progress, emit, str(exc))
        except Exception as exc:  # a bug or a malformed answer must end this call, not hang its stream
            log.exception("remote tier %s: call failed", self.name)
            self._fail(request, progress, emit, f"{type(exc).__name__}: {exc}")
        finally:
            self._running -= 1

    async def embed(self, texts: list[str], dimensions: int | None) -> tuple[np.ndarray, int]:
        """The server's `/v1/embeddings` for `texts`: the vectors, and the prompt tokens it reports (0: none)."""
        if self._client is None:
            raise EngineUnavailable(f"tier {self.name!r} is not started")
        model = self.config.embedding_model or self.config.model
        body: dict[str, Any] = {"model": model, "input": texts, "encoding_format": "float"}
        if dimensions is not None:
            body["dimensions"] = dimensions
        try:
            response = await self._client.post("/v1/embeddings", json=body)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"tier {self.name!r}: {exc}") from exc
        if response.status_code >= 400:
            raise RequestRejected(f"the remote server refused the embedding: {response.text[:300]}")
        payload = response.json()
        rows = sorted(payload["data"], key=lambda d: d["index"])
        vectors = np.asarray([d["embedding"] for d in rows], dtype=np.float32)
        return vectors, int((payload.get("usage") or {}).get("prompt_tokens") or 0)

    def _fail(
        self, request: EngineRequest, progress: _Progress, emit: Callable[[RequestOutput | _Failed], None], why: str
    ) -> None:
        log.warning("remote tier %s (%s): %s", self.name, self.config.url, why)
        if progress.produced:  # the client saw text: end it as an engine error, with what ran counted
            emit(_output(request, progress, "", FinishReason.ERROR, f"remote failed: {why}"))
        else:
            emit(_Failed(request.request_id, EngineUnavailable(f"remote tier {self.name}: {why}")))

    async def _call_with_retries(
        self, request: EngineRequest, progress: _Progress, emit: Callable[[RequestOutput | _Failed], None]
    ) -> None:
        body = self._body(request)
        for attempt in range(self.config.max_retries + 1):
            admission = self.breaker.admit()
            if admission is None:
                raise _Failure("circuit open after repeated failures", retryable=False)
            progress.answered = False
            try:
                await self._attempt(request, body, progress, emit)
                return
            except (_Failure, httpx.TransportError) as exc:
                self._failures += 1
                self.breaker.record_failure()
                failure = exc if isinstance(exc, _Failure) else _transport_failure(exc)
                if progress.produced or not failure.retryable or attempt == self.config.max_retries:
                    raise failure from None
                self._retries += 1
                await asyncio.sleep(failure.retry_after or self._backoff(attempt))
            finally:
                if not progress.answered:  # cancelled with no verdict: free the half-open trial
                    self.breaker.release(admission)

    def _backoff(self, attempt: int) -> float:
        delay = min(self.config.max_backoff_s, self.config.backoff_s * 2**attempt)
        return delay * random.uniform(0.5, 1.0)  # jitter: many callers retrying in step would hit the remote together

    async def _attempt(
        self,
        request: EngineRequest,
        body: dict[str, Any],
        progress: _Progress,
        emit: Callable[[RequestOutput | _Failed], None],
    ) -> None:
        client = self._client
        if client is None:
            raise _Failure("the remote tier is shut down", retryable=False)
        self._calls += 1
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise self._refusal(response, progress)
            data: list[str] = []  # the `data:` lines of the server-sent event being read
            done = False  # read on after `[DONE]` to the body's end, so the connection is kept alive
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                elif not line and data:
                    payload, data = "\n".join(data), []
                    done = done or payload.strip() == "[DONE]"
                    if not done:
                        self._on_chunk(request, _chunk(payload), progress, emit)
        if progress.reason is None:
            raise _Failure("the stream ended before its finish reason", retryable=True)
        emit(_output(request, progress, "", progress.reason))

    def _on_chunk(
        self,
        request: EngineRequest,
        chunk: dict[str, Any],
        progress: _Progress,
        emit: Callable[[RequestOutput | _Failed], None],
    ) -> None:
        if "error" in chunk:  # an error event in the stream
            raise _Failure(f"the remote reported: {_message(chunk)}", retryable=False)
        if not progress.answered:
            progress.answered = True
            self.breaker.record_success()
        for choice in chunk.get("choices") or []:
            text = choice.get("text") or ""
            if text:
                progress.completion_tokens += 1  # a chunk per token; the final usage corrects it
                progress.produced = True
                emit(_output(request, progress, text, None))
            if reason := choice.get("finish_reason"):
                progress.reason = REASONS.get(reason, FinishReason.STOP)
                progress.produced = True
        if usage := chunk.get("usage"):
            progress.completion_tokens = int(usage.get("completion_tokens", progress.completion_tokens))
            details = usage.get("prompt_tokens_details") or {}
            progress.cached_tokens = int(details.get("cached_tokens") or 0)

    def _refusal(self, response: httpx.Response, progress: _Progress) -> Exception:
        status, message = response.status_code, _message(_json(response))
        if status in RETRY_STATUSES:
            return _Failure(f"HTTP {status}: {message}", retryable=True, retry_after=self._retry_after(response))
        if 400 <= status < 500 and status not in CONFIG_STATUSES:
            progress.answered = True  # the remote is up and judged the request
            self.breaker.record_success()
            error = _json(response).get("error")
            code = error.get("code") if isinstance(error, dict) else None
            return RequestRejected(f"The model server refused the request: {message}", code=code)
        return _Failure(f"HTTP {status}: {message}", retryable=False)

    def _retry_after(self, response: httpx.Response) -> float | None:
        value = response.headers.get("retry-after")
        if value is None:
            return None
        try:
            seconds = float(value)
        except ValueError:
            try:
                seconds = parsedate_to_datetime(value).timestamp() - time.time()
            except (TypeError, ValueError):
                return None
        return min(max(seconds, 0.0), self.config.max_retry_after_s)

    def _prompt(self, ids: list[int]) -> list[int] | str:
        if self.config.prompt_format == "tokens":
            return ids
        return self._tokenizer.backend.decode(ids, skip_special_tokens=False)

    def _body(self, request: EngineRequest) -> dict[str, Any]:
        p = request.params
        body: dict[str, Any] = {
            "model": self.config.model,
            "prompt": self._prompt(request.prompt_token_ids),
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if p.top_k:
            body["top_k"] = p.top_k
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if p.logit_bias:  # the same tokenizer's ids: the server behind a tier shares its model's vocabulary
            body["logit_bias"] = {str(token): bias for token, bias in p.logit_bias}
        return body


class RemoteStream:
    """The outputs of a group of calls, in the order they arrive (one task per call, one queue for all)."""

    def __init__(self, engine: RemoteEngine, requests: list[EngineRequest]) -> None:
        self._queue: asyncio.Queue[RequestOutput | _Failed] = asyncio.Queue()
        self._requests = {r.request_id: r for r in requests}
        self.pending = set(self._requests)
        self.last: dict[str, RequestOutput] = {}
        self._delivered = False
        self._tasks = [asyncio.create_task(engine.call(r, self._queue.put_nowait)) for r in requests]

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.pending:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, _Failed):
            if not self._delivered:  # nothing reached the caller: it may fall back, or refuse the request
                raise item.error
            request = self._requests[item.request_id]
            item = _output(request, _Progress(len(request.prompt_token_ids)), "", FinishReason.ERROR, str(item.error))
        self._delivered = True
        return self._record(item)

    def _record(self, out: RequestOutput) -> RequestOutput:
        self.last[out.request_id] = out
        if out.finished:
            self.pending.discard(out.request_id)
        return out

    async def aclose(self) -> None:
        """Cancel what is unfinished (closing its connection aborts it remotely) and count what arrived."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while not self._queue.empty():  # arrived but unread: it ran, so it counts
            if isinstance(item := self._queue.get_nowait(), RequestOutput):
                self._record(item)
        for request_id in list(self.pending):
            request = self._requests[request_id]
            base = self.last.get(request_id) or _output(request, _Progress(len(request.prompt_token_ids)), "", None)
            self._record(replace(base, text="", finish_reason=FinishReason.ABORT))


def _output(
    request: EngineRequest, progress: _Progress, text: str, reason: FinishReason | None, error: str | None = None
) -> RequestOutput:
    return RequestOutput(
        request.request_id,
        [],  # the remote sends text, not token ids
        text,
        progress.prompt_tokens,
        progress.completion_tokens,
        reason,
        error,
        cached_tokens=progress.cached_tokens,
    )


def _transport_failure(exc: httpx.TransportError) -> _Failure:
    # A read timeout means a slow remote, still working: a retry would pile a duplicate onto it.
    retryable = not isinstance(exc, httpx.ReadTimeout | httpx.WriteTimeout)
    return _Failure(f"{type(exc).__name__}: {exc or 'no detail'}", retryable=retryable)


def _chunk(payload: str) -> dict[str, Any]:
    try:
        chunk = json.loads(payload)
    except ValueError:
        chunk = None
    if not isinstance(chunk, dict):
        raise _Failure(f"the remote sent a chunk that is not a JSON object: {payload[:200]!r}", retryable=False)
    return chunk


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {"error": {"message": response.text[:500] or response.reason_phrase}}
    return body if isinstance(body, dict) else {}


def _message(body: dict[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or body.get("detail") or body or "no detail")
