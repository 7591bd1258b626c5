"""`POST /v1/chat/completions`: start the request in the pipeline, answer it (`gateway.api.serving.respond`)
in the chat shapes (`gateway.api.chat.serving`)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gateway.api.auth import CurrentPrincipal
from gateway.api.chat.serving import chat_events, chat_result
from gateway.api.deps import PipelineDep
from gateway.api.serving import CACHE_CONTROL, generation_responses, respond
from gateway.http.errors import documented
from gateway.http.schemas import ChatCompletion, ChatCompletionRequest

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["openai"], responses=documented(400, 401, 413, 503))


@router.post(
    "/chat/completions", response_model=ChatCompletion, responses=generation_responses("chat.completion.chunk")
)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, principal: CurrentPrincipal, pipeline: PipelineDep
) -> Response:
    gen = await pipeline.start_chat(principal, body, request.headers.get(CACHE_CONTROL))
    return await respond(request, pipeline, gen, body, chat_events, chat_result)
