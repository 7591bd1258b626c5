"""`POST /v1/completions`: start the request in the pipeline, answer it (`gateway.api.serving.respond`) in the
completion shapes (`gateway.api.completions.serving`)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gateway.api.auth import CurrentPrincipal
from gateway.api.completions.serving import completion_events, completion_result
from gateway.api.deps import PipelineDep
from gateway.api.serving import CACHE_CONTROL, generation_responses, respond
from gateway.http.errors import documented
from gateway.http.schemas import Completion, CompletionRequest

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["openai"], responses=documented(400, 401, 413, 503))


@router.post("/completions", response_model=Completion, responses=generation_responses("text_completion"))
async def completions(
    body: CompletionRequest, request: Request, principal: CurrentPrincipal, pipeline: PipelineDep
) -> Response:
    gen = await pipeline.start_completion(principal, body, request.headers.get(CACHE_CONTROL))
    return await respond(request, pipeline, gen, body, completion_events, completion_result)
