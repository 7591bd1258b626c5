"""`POST /v1/messages` and `/v1/messages/count_tokens`, Anthropic's Messages API: translated to chat and run in the
one pipeline (`gateway.pipeline.wires.MESSAGES`); the key comes as `x-api-key` (or a bearer token), and errors
leave in Anthropic's shape (`shape_errors` in `gateway.app`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request, Response

from gateway.api.auth import ApiKeyPrincipal
from gateway.api.deps import PipelineDep
from gateway.api.messages.protocol import AnthropicError, AnthropicMessage, CountTokensRequest, MessagesRequest
from gateway.api.messages.serving import message_events, whole
from gateway.api.messages.translate import chat_request
from gateway.api.serving import CACHE_CONTROL, generation_responses, respond
from gateway.http.errors import documented
from gateway.pipeline import MESSAGES

__all__ = ["PREFIX", "router"]

PREFIX = "/v1/messages"
router = APIRouter(prefix=PREFIX, tags=["anthropic"], responses=documented(400, 401, 413, 503, shape=AnthropicError))
Version = Annotated[
    str | None, Header(alias="anthropic-version", description="accepted; every version is served alike")
]


@router.post("", response_model=AnthropicMessage, responses=generation_responses("Messages API event", AnthropicError))
async def create_message(
    body: MessagesRequest, request: Request, principal: ApiKeyPrincipal, pipeline: PipelineDep, version: Version = None
) -> Response:
    chat = chat_request(body)
    gen = await pipeline.start_chat(principal, chat, request.headers.get(CACHE_CONTROL), wire=MESSAGES)
    return await respond(
        request,
        pipeline,
        gen,
        chat,
        lambda g, _usage: message_events(g),
        lambda g, texts, reasons: whole(g, texts[0], reasons[0]),
    )


@router.post("/count_tokens")
async def count_tokens(
    body: CountTokensRequest, principal: ApiKeyPrincipal, pipeline: PipelineDep, version: Version = None
) -> dict[str, int]:
    """The prompt's tokens on the tier it names, through its chat template with the tools (`auto`: the cheapest
    tier the policy allows); nothing runs and nothing is billed."""
    return {"input_tokens": await pipeline.count_chat(principal, chat_request(body), MESSAGES)}
