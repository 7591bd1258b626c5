"""`/v1/responses`: create (translated to chat and run in the one pipeline, `gateway.pipeline.wires.RESPONSES`),
retrieve, delete, and a stored response's input items."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, Query, Request, Response

from gateway.accounting.tenants import Principal
from gateway.api.auth import CurrentPrincipal
from gateway.api.deps import DatabaseDep, PipelineDep, SettingsDep
from gateway.api.responses.protocol import ResponseObject, ResponsesRequest
from gateway.api.responses.serving import Keep, response_events, whole
from gateway.api.responses.store import ResponseStore
from gateway.api.responses.translate import chat_request, input_items
from gateway.api.serving import CACHE_CONTROL, generation_responses, respond
from gateway.http.errors import documented
from gateway.pipeline import RESPONSES

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["openai"], responses=documented(400, 401, 404, 413, 503))


async def get_store(db: DatabaseDep, settings: SettingsDep) -> ResponseStore:
    return ResponseStore(db, settings.responses_retention_days)


StoreDep = Annotated[ResponseStore, Depends(get_store)]


@router.post("/responses", response_model=ResponseObject, responses=generation_responses("response event"))
async def create_response(
    body: ResponsesRequest, request: Request, principal: CurrentPrincipal, pipeline: PipelineDep, store: StoreDep
) -> Response:
    items = input_items(body)
    context: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = await anyio.to_thread.run_sync(
            store.get, principal.tenant_id, body.previous_response_id, "previous_response_id"
        )
        context = previous.context
    chat = chat_request(body, context, items)
    continued = body.previous_response_id is not None  # a stored conversation stays on its tier under `auto`
    gen = await pipeline.start_chat(
        principal, chat, request.headers.get(CACHE_CONTROL), wire=RESPONSES, continued=continued
    )
    keep = _keeper(store, principal, context, items) if body.store else None
    return await respond(
        request,
        pipeline,
        gen,
        chat,
        lambda g, _usage: response_events(body, g, keep),
        lambda g, texts, reasons: whole(body, g, texts[0], reasons[0]),
        keep,
    )


def _keeper(store: ResponseStore, principal: Principal, context: list, items: list) -> Keep:
    async def keep(response: ResponseObject) -> None:
        shown = response.model_dump()
        said = [_as_input(item) for item in shown["output"]]
        await anyio.to_thread.run_sync(store.save, principal.tenant_id, shown, items, [*context, *items, *said])

    return keep


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the next turn reads it: a message's text parts only."""
    if item["type"] != "message":
        return item
    parts = [{"type": "output_text", "text": p["text"]} for p in item["content"]]
    return {"type": "message", "id": item["id"], "role": "assistant", "content": parts}


@router.get("/responses/{response_id}", response_model=ResponseObject)
async def get_response(response_id: str, principal: CurrentPrincipal, store: StoreDep) -> dict[str, Any]:
    return (await anyio.to_thread.run_sync(store.get, principal.tenant_id, response_id)).response


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, principal: CurrentPrincipal, store: StoreDep) -> dict[str, Any]:
    await anyio.to_thread.run_sync(store.delete, principal.tenant_id, response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    principal: CurrentPrincipal,
    store: StoreDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """This response's own input items (not its predecessors'), newest first by default, as OpenAI pages them."""
    items = (await anyio.to_thread.run_sync(store.get, principal.tenant_id, response_id)).input_items
    items = items[::-1] if order == "desc" else list(items)
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
