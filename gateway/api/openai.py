"""The OpenAI-compatible API: chat completions, completions and models.

Routes only translate between HTTP and the pipeline: validation lives in the schemas and the pipeline,
generation in the engines.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel
from starlette.background import BackgroundTask

from gateway.auth import CurrentPrincipal
from gateway.errors import APIError, documented
from gateway.logging_setup import request_id_var
from gateway.pipeline import ChoiceDelta, Generation, Pipeline, model_not_found
from gateway.routing import AUTO
from gateway.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    chunk_json,
)
from gateway.streaming import ClientDisconnected, EventStreamResponse, sse, until_disconnect

router = APIRouter(prefix="/v1", tags=["openai"], responses=documented(401, 413, 422, 503))


def _generation_responses(chunk: str) -> dict[int | str, dict[str, Any]]:
    """A generation answers JSON, or server-sent events with `stream: true`; and these refuse one."""
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string", "description": f"a `{chunk}` as JSON; the last event is `[DONE]`"}},
    }
    return {200: {"content": {"text/event-stream": {"schema": event}}}, **documented(400, 403, 404, 429)}


CACHE_CONTROL = "x-switchboard-cache-control"  # no-cache | no-store, like the body's `cache` field
TIER_HEADER = "x-switchboard-tier"  # the tier that served: the requested one (or the router's), or its fallback
ROUTE_P_HEADER = "x-switchboard-route-p-small"  # routed requests: the router's P(small is good enough)
# Non-streamed responses whose policy runs verifiers: what they did, `choice:verifier:action@tokens`
# comma-separated, or `none`; the usage record holds the same with scores and reasons (streams too).
VERIFIERS_HEADER = "x-switchboard-verifiers"
# A cascaded answer: `small>large; first=<the failed attempt's id>` (both attempts are in the ledger).
CASCADE_HEADER = "x-switchboard-cascade"


def verifiers_header(actions: list[dict]) -> str:
    return ",".join(f"{a['choice']}:{a['verifier']}:{a['action']}@{a['tokens']}" for a in actions) or "none"


def _pipeline(request: Request) -> Pipeline:
    return request.app.state.pipeline


@router.post(
    "/chat/completions", response_model=ChatCompletion, responses=_generation_responses("chat.completion.chunk")
)
async def chat_completions(body: ChatCompletionRequest, request: Request, principal: CurrentPrincipal) -> Response:
    gen = await _pipeline(request).start_chat(principal, body, request.headers.get(CACHE_CONTROL))

    def result(gen: Generation, texts: list[str], reasons: list[str | None]) -> ChatCompletion:
        choices = [
            ChatChoice(index=i, message=ChatMessageOut(content=t), finish_reason=r)
            for i, (t, r) in enumerate(zip(texts, reasons, strict=True))
        ]
        return ChatCompletion(id=gen.request_id, created=gen.created, model=gen.model, choices=choices, usage=gen.usage)

    return await _respond(request, gen, body, _chat_events, result)


@router.post("/completions", response_model=Completion, responses=_generation_responses("text_completion"))
async def completions(body: CompletionRequest, request: Request, principal: CurrentPrincipal) -> Response:
    gen = await _pipeline(request).start_completion(principal, body, request.headers.get(CACHE_CONTROL))

    def result(gen: Generation, texts: list[str], reasons: list[str | None]) -> Completion:
        choices = [
            CompletionChoice(index=i, text=t, finish_reason=r)
            for i, (t, r) in enumerate(zip(texts, reasons, strict=True))
        ]
        return Completion(id=gen.request_id, created=gen.created, model=gen.model, choices=choices, usage=gen.usage)

    return await _respond(request, gen, body, _completion_events, result)


async def _respond(
    request: Request,
    gen: Generation,
    body: ChatCompletionRequest | CompletionRequest,
    events: Callable[[Generation, bool], AsyncIterator[str]],
    result: Callable[[Generation, list[str], list[str | None]], BaseModel],
) -> Response:
    """Stream SSE, or run to the end (aborting if the client leaves) and answer with `result`."""
    headers = {"x-request-id": gen.request_id, "x-switchboard-cache": gen.cache.header}
    request_id_var.set(gen.request_id)  # from here on, log lines carry the id of the response and the ledger row
    if gen.cache.answer is not None:  # which of this tenant's earlier requests answered it
        headers["x-switchboard-cache-source"] = gen.cache.answer.request_id
    if gen.route is not None:
        headers[ROUTE_P_HEADER] = f"{gen.route.p_small_ok:.3f}"

    async def closed() -> None:  # the stream ended, however: bill or release, then what follows a response
        await gen.abandon()
        await gen.after_response()

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        try:
            if gen.cache.answer is None:  # before the headers: the tier that serves (a fallback?) goes in them
                await until_disconnect(request, gen.begin())
        except BaseException as exc:
            await gen.abandon()  # bills what ran, or gives the reservation back
            if isinstance(exc, ClientDisconnected):
                return Response(status_code=499)
            raise
        headers[TIER_HEADER] = gen.tier
        return EventStreamResponse(events(gen, include_usage), headers=headers, on_close=closed)
    try:
        # A cached answer is ready at once: no generation to abort, so no disconnect watcher to start.
        work = _collect(gen)
        texts, reasons = await (work if gen.cache.answer is not None else until_disconnect(request, work))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the status is for the access log
    finally:
        await gen.abandon()  # a no-op once it ran
    if gen.hooks:
        headers[VERIFIERS_HEADER] = verifiers_header(gen.verifier_actions)
    if gen.escalation is not None:  # the policy's cascade: the failed answer is retried on a larger tier
        first = gen
        try:
            gen = await _pipeline(request).escalate(first, body)
            try:
                texts, reasons = await until_disconnect(request, _collect(gen))
            finally:
                await gen.abandon()
            headers[CASCADE_HEADER] = f"{first.tier}>{gen.tier}; first={first.request_id}"
            headers["x-request-id"] = gen.request_id
        except ClientDisconnected:
            return Response(status_code=499)
        except APIError as exc:  # the larger tier refused (budget, rate limit, down): the first answer stands
            gen = first
            headers[CASCADE_HEADER] = f"{first.tier}; not escalated: {exc.code or exc.status}"
    headers[TIER_HEADER] = gen.tier
    body_json = result(gen, texts, reasons).model_dump_json()
    # after_response runs once the body is sent (Starlette's background task), never on the request's path
    return Response(
        body_json, media_type="application/json", headers=headers, background=BackgroundTask(gen.after_response)
    )


@router.get("/models", response_model=ModelList)
async def list_models(request: Request, principal: CurrentPrincipal) -> ModelList:
    """The tiers this tenant's policy allows, and `auto` (the router picks) when a router is loaded."""
    created = request.app.state.started
    pipeline = _pipeline(request)
    policy = (await pipeline.policy(principal)).policy
    names = [name for name in pipeline.engines if policy.allows(name)]
    if pipeline.routing.offered(policy):
        names.append(AUTO)
    return ModelList(data=[ModelCard(id=name, created=created) for name in names])


@router.get("/models/{model}", response_model=ModelCard, responses=documented(404))
async def get_model(model: str, request: Request, principal: CurrentPrincipal) -> ModelCard:
    pipeline = _pipeline(request)
    policy = (await pipeline.policy(principal)).policy
    served = model in pipeline.engines and policy.allows(model)
    if not served and not (model == AUTO and pipeline.routing.offered(policy)):
        raise model_not_found(model)
    return ModelCard(id=model, created=request.app.state.started)


async def _collect(gen: Generation) -> tuple[list[str], list[str | None]]:
    texts = [""] * gen.num_choices
    reasons: list[str | None] = [None] * gen.num_choices
    async with aclosing(gen.events()) as events:
        async for delta in events:
            texts[delta.index] += delta.text
            reasons[delta.index] = delta.finish_reason or reasons[delta.index]
    return texts, reasons


async def _chat_events(gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: bool = False) -> str:
        c = ChatCompletionChunk(
            id=gen.request_id, created=gen.created, model=gen.model, choices=choices, usage=gen.usage if usage else None
        )
        return sse(chunk_json(c, include_usage))

    def delta_chunks(d: ChoiceDelta) -> list[str]:
        out = []
        if d.text:
            out.append(chunk([ChatChunkChoice(index=d.index, delta=ChatDelta(content=d.text))]))
        if d.finish_reason:
            out.append(chunk([ChatChunkChoice(index=d.index, delta=ChatDelta(), finish_reason=d.finish_reason)]))
        return out

    for i in range(gen.num_choices):
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    async for payload in _stream(gen, delta_chunks, (lambda: chunk([], usage=True)) if include_usage else None):
        yield payload


async def _completion_events(gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[CompletionChoice], usage: bool = False) -> str:
        c = Completion(
            id=gen.request_id, created=gen.created, model=gen.model, choices=choices, usage=gen.usage if usage else None
        )
        return sse(chunk_json(c, include_usage))

    def delta_chunks(d: ChoiceDelta) -> list[str]:
        return [chunk([CompletionChoice(index=d.index, text=d.text, finish_reason=d.finish_reason)])]

    async for payload in _stream(gen, delta_chunks, (lambda: chunk([], usage=True)) if include_usage else None):
        yield payload


async def _stream(
    gen: Generation, render: Callable[[ChoiceDelta], list[str]], usage_chunk: Callable[[], str] | None
) -> AsyncIterator[str]:
    """Rendered deltas, then the usage chunk if asked for, then `[DONE]`.

    An error after the stream started becomes an OpenAI error event; what ran is still reported.
    """
    try:
        async with aclosing(gen.events()) as events:
            async for delta in events:
                for payload in render(delta):
                    yield payload
    except APIError as exc:
        yield sse(json.dumps(exc.body()))
    if usage_chunk is not None:
        yield usage_chunk()
    yield sse("[DONE]")
