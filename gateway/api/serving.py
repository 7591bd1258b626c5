"""What every generation endpoint shares between the pipeline and HTTP (vLLM's `serving` base): run a started
`Generation` and answer it, as server-sent events (`stream: true`: the tier that serves in the headers, which
go out before the first token) or as one JSON body once the answer is complete (through the cascade; a client
that leaves aborts the run, 499), with switchboard's headers: the request id, the cache's verdict and source,
the router's predictions, what the verifiers did, the cascade's retry and the tier. Follow-ups (stored
prompts, shadow runs) run once the body is sent, never on the request's path.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Any

from fastapi import Request, Response
from pydantic import BaseModel
from starlette.background import BackgroundTask

from gateway.http.errors import APIError, ErrorResponse, documented
from gateway.http.logging_setup import request_id_var
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from gateway.http.streaming import ClientDisconnected, EventStreamResponse, sse, until_disconnect
from gateway.pipeline import Answer, ChoiceDelta, Generation, Pipeline

__all__ = [
    "CACHE_CONTROL",
    "CASCADE_HEADER",
    "ROUTE_HEADER",
    "ROUTE_P_HEADER",
    "TIER_HEADER",
    "VERIFIERS_HEADER",
    "asked_logprobs",
    "cached_tokens",
    "fed",
    "generation_responses",
    "respond",
    "stream",
    "verifiers_header",
]


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


def generation_responses(chunk: str, shape: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """A generation answers JSON, or server-sent events with `stream: true`; and these refuse one (in `shape`)."""
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string", "description": f"a `{chunk}` as JSON; the last event is `[DONE]`"}},
    }
    return {200: {"content": {"text/event-stream": {"schema": event}}}, **documented(400, 403, 404, 429, shape=shape)}


def verifiers_header(actions: list[dict]) -> str:
    return ",".join(f"{a['choice']}:{a['verifier']}:{a['action']}@{a['tokens']}" for a in actions) or "none"


def cached_tokens(gen: Generation) -> int:
    """Prompt tokens the engine's prefix cache served (the least-cached choice's; 0 for a response-cache answer),
    as the Responses and Messages APIs report them."""
    return min((o.cached_tokens for o in gen.last_outputs if o is not None), default=0)


def asked_logprobs(gen: Generation) -> int | None:
    """The alternatives per token the request asked for (0: the chosen token only), None for no logprobs."""
    return gen.plan.work.requests[0].params.logprobs


async def respond(
    request: Request,
    pipeline: Pipeline,
    gen: Generation,
    body: ChatCompletionRequest | CompletionRequest,
    events: Callable[[Generation, bool], AsyncIterator[str]],
    result: Callable[[Generation, list[str], list[str | None]], BaseModel],
    keep: Callable[[Any], Awaitable[None]] | None = None,
) -> Response:
    """Stream SSE, or run to the end (aborting if the client leaves) and answer with `result` (given to `keep`
    first, where the API stores its answers)."""
    plan = gen.plan
    headers = {"x-request-id": gen.request_id, "x-switchboard-cache": plan.cache.header}
    request_id_var.set(gen.request_id)  # from here on, log lines carry the id of the response and the ledger row
    if plan.cache.answer is not None:  # which of this tenant's earlier requests answered it
        headers["x-switchboard-cache-source"] = plan.cache.answer.request_id
    if plan.route is not None and plan.route.features == "lock":  # a tool loop's turn, on its conversation's tier
        headers[ROUTE_HEADER] = f"{plan.route.tier}; lock"
    elif plan.route is not None:
        headers[ROUTE_P_HEADER] = f"{plan.route.p_small_ok:.3f}"
        predicted = ",".join(f"{tier}={p:.3f}" for tier, p in sorted(plan.route.p_ok.items()))
        notes = [plan.route.features, *(["learned"] if plan.route.learned else [])]
        if not plan.route.known:  # unlike the router's labels: not below a tier whose quality is known for it
            notes.append(f"unknown {plan.route.why}")
        headers[ROUTE_HEADER] = f"{predicted}; {'; '.join(notes)}"
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
    shaped = result(final, answer.texts, answer.reasons)
    if keep is not None:
        await keep(shaped)
    body_json = shaped.model_dump_json()
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


async def stream(
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


async def fed(
    gen: Generation, feed: Callable[[str, bool], list[dict[str, Any]]], reasons: list[str]
) -> AsyncIterator[dict[str, Any]]:
    """A typed stream's payloads (Responses, Messages): each delta's text fed to the API's builder (`last` on the
    delta that finishes it), whose finish reason is appended to `reasons`."""
    async with aclosing(gen.events()) as deltas:
        async for d in deltas:
            if d.finish_reason is not None:
                reasons.append(d.finish_reason)
            for payload in feed(d.text, d.finish_reason is not None):
                yield payload
