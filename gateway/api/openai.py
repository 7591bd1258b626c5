"""The OpenAI-compatible API: chat completions, completions and models.

Routes only translate between HTTP and the pipeline: validation lives in the schemas and the pipeline,
generation in the engines.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel
from starlette.background import BackgroundTask

from gateway.api.auth import CurrentPrincipal
from gateway.api.deps import PipelineDep, StartedDep
from gateway.api.logprobs import chat_logprobs, completion_logprobs
from gateway.http.errors import APIError, documented
from gateway.http.logging_setup import request_id_var
from gateway.http.schemas import (
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
    ToolCall,
    ToolCallDelta,
    chunk_json,
)
from gateway.http.streaming import ClientDisconnected, EventStreamResponse, sse, until_disconnect
from gateway.pipeline import Answer, ChoiceDelta, Generation, Pipeline, model_not_found
from gateway.routing.stage import AUTO
from gateway.tool_calls import CallParser, CallSpec, ParsedCall, Piece, parse_answer

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
# Routed requests: every tier's predicted P(good enough) and what it was read from, e.g.
# `tiny=0.412,small=0.873; hidden` (hidden: the small tier's hidden state; text: the text router).
ROUTE_HEADER = "x-switchboard-route"
# Non-streamed responses whose policy runs verifiers: what they did, `choice:verifier:action@tokens`
# comma-separated, or `none`; the usage record holds the same with scores and reasons (streams too).
VERIFIERS_HEADER = "x-switchboard-verifiers"
# A cascaded answer: `small>large; first=<the failed attempt's id>` (both attempts are in the ledger).
CASCADE_HEADER = "x-switchboard-cascade"


def verifiers_header(actions: list[dict]) -> str:
    return ",".join(f"{a['choice']}:{a['verifier']}:{a['action']}@{a['tokens']}" for a in actions) or "none"


@router.post(
    "/chat/completions", response_model=ChatCompletion, responses=_generation_responses("chat.completion.chunk")
)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, principal: CurrentPrincipal, pipeline: PipelineDep
) -> Response:
    gen = await pipeline.start_chat(principal, body, request.headers.get(CACHE_CONTROL))

    def result(gen: Generation, texts: list[str], reasons: list[str | None]) -> ChatCompletion:
        choices = [_chat_choice(i, t, r, gen.plan.calls) for i, (t, r) in enumerate(zip(texts, reasons, strict=True))]
        if (k := _asked(gen)) is not None:
            for choice, tokens in zip(choices, gen.logprobs, strict=True):
                choice.logprobs = chat_logprobs(tokens, gen.tokenizer, k)
        return ChatCompletion(id=gen.request_id, created=gen.created, model=gen.model, choices=choices, usage=gen.usage)

    return await _respond(request, pipeline, gen, body, _chat_events, result)


def _chat_choice(index: int, text: str, reason: str | None, calls: CallSpec | None) -> ChatChoice:
    """One choice; with tools, its text read for calls (`gateway.tool_calls`)."""
    if calls is None:
        return ChatChoice(index=index, message=ChatMessageOut(content=text), finish_reason=reason)
    content, parsed = parse_answer(text, calls)
    message = ChatMessageOut(content=content, tool_calls=[_tool_call(c) for c in parsed] or None)
    return ChatChoice(index=index, message=message, finish_reason=_reason(reason, bool(parsed)))


def _asked(gen: Generation) -> int | None:
    """The alternatives per token the request asked for (0: the chosen token only), None for no logprobs."""
    return gen.plan.work.requests[0].params.logprobs


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall.model_validate({"id": call.id, "function": {"name": call.name, "arguments": call.arguments}})


def _reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's `tool_calls` for an answer that ended by itself with calls; a cut one stays `length`."""
    return "tool_calls" if called and reason == "stop" else reason


@router.post("/completions", response_model=Completion, responses=_generation_responses("text_completion"))
async def completions(
    body: CompletionRequest, request: Request, principal: CurrentPrincipal, pipeline: PipelineDep
) -> Response:
    gen = await pipeline.start_completion(principal, body, request.headers.get(CACHE_CONTROL))

    def result(gen: Generation, texts: list[str], reasons: list[str | None]) -> Completion:
        k = _asked(gen)
        choices = [
            CompletionChoice(index=i, text=t, finish_reason=r,
                             logprobs=None if k is None else completion_logprobs(gen.logprobs[i], gen.tokenizer, k))
            for i, (t, r) in enumerate(zip(texts, reasons, strict=True))
        ]  # fmt: skip
        return Completion(id=gen.request_id, created=gen.created, model=gen.model, choices=choices, usage=gen.usage)

    return await _respond(request, pipeline, gen, body, _completion_events, result)


async def _respond(
    request: Request,
    pipeline: Pipeline,
    gen: Generation,
    body: ChatCompletionRequest | CompletionRequest,
    events: Callable[[Generation, bool], AsyncIterator[str]],
    result: Callable[[Generation, list[str], list[str | None]], BaseModel],
) -> Response:
    """Stream SSE, or run to the end (aborting if the client leaves) and answer with `result`."""
    plan = gen.plan
    headers = {"x-request-id": gen.request_id, "x-switchboard-cache": plan.cache.header}
    request_id_var.set(gen.request_id)  # from here on, log lines carry the id of the response and the ledger row
    if plan.cache.answer is not None:  # which of this tenant's earlier requests answered it
        headers["x-switchboard-cache-source"] = plan.cache.answer.request_id
    if plan.route is not None:
        headers[ROUTE_P_HEADER] = f"{plan.route.p_small_ok:.3f}"
        predicted = ",".join(f"{tier}={p:.3f}" for tier, p in sorted(plan.route.p_ok.items()))
        headers[ROUTE_HEADER] = f"{predicted}; {plan.route.features}"
        headers["x-switchboard-route-ms"] = f"{plan.route.seconds * 1000:.1f}"
    watch = partial(until_disconnect, request)
    try:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            await gen.begin_stream(watch)  # before the headers: the tier that serves (a fallback?) goes in them
            headers[TIER_HEADER] = gen.tier
            return EventStreamResponse(events(gen, include_usage), headers=headers, on_close=gen.close)
        answer = await pipeline.complete(gen, body, watch)
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the status is for the access log
    _answer_headers(answer, headers)
    final = answer.generation
    body_json = result(final, answer.texts, answer.reasons).model_dump_json()
    # after_response runs once the body is sent (Starlette's background task), never on the request's path
    return Response(
        body_json, media_type="application/json", headers=headers, background=BackgroundTask(final.after_response)
    )


def _answer_headers(answer: Answer, headers: dict[str, str]) -> None:
    """What the verifiers did to the first answer, the cascade's retry if there was one, and the tier."""
    first, final = answer.first, answer.generation
    if first.plan.checks.hooks:
        headers[VERIFIERS_HEADER] = verifiers_header(first.verifier_actions)
    if answer.refused is not None:  # the larger tier refused (budget, rate limit, down): the first answer stands
        headers[CASCADE_HEADER] = f"{first.tier}; not escalated: {answer.refused}"
    elif answer.escalated:  # the policy's cascade: the failed answer was retried on a larger tier
        headers[CASCADE_HEADER] = f"{first.tier}>{final.tier}; first={first.request_id}"
        headers["x-request-id"] = final.request_id
    headers[TIER_HEADER] = final.tier


@router.get("/models", response_model=ModelList)
async def list_models(principal: CurrentPrincipal, pipeline: PipelineDep, created: StartedDep) -> ModelList:
    """The tiers this tenant's policy allows, and `auto` (the router picks) when a router is loaded."""
    policy = (await pipeline.policy(principal)).policy
    names = [name for name in pipeline.engines if policy.allows(name)]
    if pipeline.routing.offered(policy):
        names.append(AUTO)
    return ModelList(data=[ModelCard(id=name, created=created) for name in names])


@router.get("/models/{model}", response_model=ModelCard, responses=documented(404))
async def get_model(model: str, principal: CurrentPrincipal, pipeline: PipelineDep, created: StartedDep) -> ModelCard:
    policy = (await pipeline.policy(principal)).policy
    served = model in pipeline.engines and policy.allows(model)
    if not served and not (model == AUTO and pipeline.routing.offered(policy)):
        raise model_not_found(model)
    return ModelCard(id=model, created=created)


async def _chat_events(gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: bool = False) -> str:
        c = ChatCompletionChunk(
            id=gen.request_id, created=gen.created, model=gen.model, choices=choices, usage=gen.usage if usage else None
        )
        return sse(chunk_json(c, include_usage))

    parsers: dict[int, CallParser] = {}
    spec, k = gen.plan.calls, _asked(gen)

    def delta_chunks(d: ChoiceDelta) -> list[str]:
        choices = tool_choices(d) if spec is not None else plain_choices(d)
        if k is not None and d.logprobs:  # the delta's tokens ride on its first chunk, or on one of their own
            if not choices:
                choices = [ChatChunkChoice(index=d.index, delta=ChatDelta())]
            choices[0].logprobs = chat_logprobs(d.logprobs, gen.tokenizer, k)
        return [chunk([c]) for c in choices]

    def tool_choices(d: ChoiceDelta) -> list[ChatChunkChoice]:
        assert spec is not None
        parser = parsers.setdefault(d.index, spec.parser())
        before = len(parser.calls)
        piece = parser.feed(d.text)
        if d.finish_reason:
            last = parser.finish()
            piece = Piece(piece.content + last.content, piece.calls + last.calls)
        out = [ChatChunkChoice(index=d.index, delta=ChatDelta(content=piece.content))] if piece.content else []
        for n, call in enumerate(piece.calls, start=before):  # the id and name first, then the arguments
            first = ToolCallDelta.model_validate({"index": n, "id": call.id, "type": "function",
                                                  "function": {"name": call.name, "arguments": ""}})  # fmt: skip
            rest = ToolCallDelta.model_validate({"index": n, "function": {"arguments": call.arguments}})
            out += [ChatChunkChoice(index=d.index, delta=ChatDelta(tool_calls=[delta])) for delta in (first, rest)]
        if d.finish_reason:
            reason = _reason(d.finish_reason, bool(parser.calls))
            out.append(ChatChunkChoice(index=d.index, delta=ChatDelta(), finish_reason=reason))
        return out

    def plain_choices(d: ChoiceDelta) -> list[ChatChunkChoice]:
        out = []
        if d.text:
            out.append(ChatChunkChoice(index=d.index, delta=ChatDelta(content=d.text)))
        if d.finish_reason:
            out.append(ChatChunkChoice(index=d.index, delta=ChatDelta(), finish_reason=d.finish_reason))
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

    k, offsets = _asked(gen), [0] * gen.num_choices

    def delta_chunks(d: ChoiceDelta) -> list[str]:
        logprobs = None
        if k is not None:
            logprobs = completion_logprobs(d.logprobs, gen.tokenizer, k, offsets[d.index])
            offsets[d.index] += sum(len(t) for t in logprobs.tokens)
        return [chunk([CompletionChoice(index=d.index, text=d.text, finish_reason=d.finish_reason, logprobs=logprobs)])]

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
