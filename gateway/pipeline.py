"""The request pipeline: one path from a validated API request to engine outputs and a usage row.

    start()   resolve the model to a tier, build the prompts, check every limit  → 4xx before anything runs
    events()  run the engine requests and stream choice deltas; record usage exactly once, however
              the stream ends (finished, client gone, engine error)

Later stages (policies, normalization, the response cache, routing, budgets, verifiers) slot in here,
in this order, so the API routes stay thin translators between HTTP and this module.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace

import anyio

from engines.async_engine import AsyncEngine, EngineUnavailable
from engines.engine import RequestRejected
from engines.request import EngineRequest, FinishReason
from engines.sampling import SamplingParams
from engines.tokenizer import ChatTemplateError, Tokenizer
from gateway.errors import APIError, invalid
from gateway.schemas import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
)
from gateway.settings import Settings
from gateway.tenants import Principal
from gateway.usage import UsageRecord, UsageRecorder


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    text: str
    finish_reason: str | None  # set on a choice's last delta


@dataclass
class Generation:
    """A request that passed every check; iterate `events()` to run it."""

    request_id: str
    endpoint: str
    model: str
    principal: Principal
    engine: AsyncEngine
    requests: list[EngineRequest]  # one per choice, in choice order
    prompt_tokens: int  # each distinct prompt counted once, as OpenAI bills n > 1
    recorder: UsageRecorder
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
    status: str = "pending"

    @property
    def num_choices(self) -> int:
        return len(self.requests)

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )

    async def events(self) -> AsyncIterator[ChoiceDelta]:
        if self.status != "pending":
            raise RuntimeError("a generation runs once")
        self.status = "running"
        started = time.perf_counter()
        index = {r.request_id: i for i, r in enumerate(self.requests)}
        reasons: list[str | None] = [None] * len(self.requests)
        try:
            stream = self.engine.open(self.requests)
        except EngineUnavailable:  # stopped between start() and now: nothing ran, nothing to record
            raise _unavailable(self.model) from None
        try:
            async for out in stream:
                self.completion_tokens = sum(o.completion_tokens for o in stream.last.values())
                if out.finish_reason is FinishReason.ERROR:
                    raise APIError(500, "The engine failed while generating; please retry.", code="engine_error")
                i = index[out.request_id]
                reasons[i] = out.finish_reason.value if out.finish_reason else None
                if out.text or reasons[i]:
                    yield ChoiceDelta(i, out.text, reasons[i])
            # the engine aborts what is left when it shuts down under a running request
            self.status = "aborted" if FinishReason.ABORT.value in reasons else "ok"
        except (asyncio.CancelledError, GeneratorExit):
            self.status = "aborted"
            raise
        except BaseException:
            self.status = "error"
            raise
        finally:
            # Shielded: a cancelled request must still be aborted, counted to its last generated
            # token (tokens still queued for a departed client included) and written down.
            with anyio.CancelScope(shield=True):
                await stream.aclose()
                self.completion_tokens = sum(o.completion_tokens for o in stream.last.values())
                rec = UsageRecord(
                    request_id=self.request_id,
                    tenant_id=self.principal.tenant_id,
                    api_key_id=self.principal.key_id,
                    endpoint=self.endpoint,
                    model=self.model,
                    prompt_tokens=self.prompt_tokens,
                    completion_tokens=self.completion_tokens,
                    latency_ms=round((time.perf_counter() - started) * 1000),
                    status=self.status,
                    finish_reason="abort" if self.status == "aborted" else reasons[0],
                )
                await anyio.to_thread.run_sync(self.recorder.record, rec)


class Pipeline:
    def __init__(self, engines: Mapping[str, AsyncEngine], recorder: UsageRecorder, settings: Settings) -> None:
        self.engines = dict(engines)
        self.recorder = recorder
        self.settings = settings

    def engine(self, model: str) -> AsyncEngine:
        engine = self.engines.get(model)
        if engine is None:
            raise model_not_found(model)
        if not engine.alive:
            raise _unavailable(model)
        return engine

    async def start_chat(self, principal: Principal, body: ChatCompletionRequest) -> Generation:
        engine = self.engine(body.model)
        _reject_unsupported(body, UNSUPPORTED_CHAT)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = await anyio.to_thread.run_sync(engine.tokenizer.encode_chat, messages)
        except ChatTemplateError as exc:
            raise invalid(str(exc), param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        return self._generation("chat.completions", "chatcmpl", principal, body, engine, [prompt], max_tokens)

    async def start_completion(self, principal: Principal, body: CompletionRequest) -> Generation:
        engine = self.engine(body.model)
        _reject_unsupported(body, UNSUPPORTED_COMPLETION)
        prompts = await anyio.to_thread.run_sync(_completion_prompts, body.prompt, engine.tokenizer)
        return self._generation("completions", "cmpl", principal, body, engine, prompts, body.max_tokens)

    def _generation(
        self,
        endpoint: str,
        id_prefix: str,
        principal: Principal,
        body: ChatCompletionRequest | CompletionRequest,
        engine: AsyncEngine,
        prompts: list[list[int]],
        max_tokens: int | None,
    ) -> Generation:
        if body.n * len(prompts) > self.settings.max_n:
            raise invalid(f"at most {self.settings.max_n} choices per request (n × prompts)", param="n")
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        # Cached prompt prefixes are shared within a tenant only, unless configured otherwise: a
        # faster first token would tell one tenant what another tenant's prompts begin with.
        salt = f"tenant:{principal.tenant_id}" if self.settings.prefix_cache_scope == "tenant" else ""
        requests = []
        for p, prompt in enumerate(prompts):
            params = self._params(body, engine, prompt, max_tokens)
            for j in range(body.n):
                seeded = params if params.seed is None else replace(params, seed=params.seed + j)
                requests.append(EngineRequest(f"{request_id}-{p * body.n + j}", prompt, seeded, cache_salt=salt))
        return Generation(
            request_id=request_id,
            endpoint=endpoint,
            model=body.model,
            principal=principal,
            engine=engine,
            requests=requests,
            prompt_tokens=sum(len(p) for p in prompts),
            recorder=self.recorder,
        )

    def _params(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        engine: AsyncEngine,
        prompt: list[int],
        max_tokens: int | None,
    ) -> SamplingParams:
        room = engine.max_model_len - len(prompt)
        if max_tokens is None:
            max_tokens = min(room, self.settings.default_max_tokens or room)
            max_tokens = max(max_tokens, 1)  # no room left: the context check below explains
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                seed=body.seed,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                stop=tuple(body.stop_list),
            )
            engine.check(prompt, params.max_tokens)
        except RequestRejected as exc:
            param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            raise invalid(str(exc), param=param, code=exc.code) from None
        except ValueError as exc:
            raise invalid(str(exc)) from None
        return params


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def _unavailable(model: str) -> APIError:
    return APIError(503, f"The model `{model}` is not serving right now; retry shortly.", code="engine_unavailable")


def _reject_unsupported(body: ChatCompletionRequest | CompletionRequest, names: tuple[str, ...]) -> None:
    if name := body.unsupported(names):
        raise invalid(f"`{name}` is not supported by this server yet.", param=name, code="unsupported_parameter")


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
