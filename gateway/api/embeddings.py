"""`POST /v1/embeddings`: OpenAI's embeddings endpoint over the gateway's embedder and remote tiers
(`gateway.pipeline.embeddings`)."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Response

from gateway.api.auth import CurrentPrincipal
from gateway.api.deps import EmbeddingsDep
from gateway.http.errors import documented
from gateway.http.schemas import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage

router = APIRouter(prefix="/v1", tags=["openai"], responses=documented(400, 401, 413, 503))


@router.post("/embeddings", response_model=EmbeddingList, responses=documented(400, 403, 404, 429))
async def embeddings(body: EmbeddingRequest, principal: CurrentPrincipal, service: EmbeddingsDep) -> Response:
    done = await service.embed(principal, body)
    data = [Embedding(index=i, embedding=_encoded(v, body.encoding_format)) for i, v in enumerate(done.vectors)]
    usage = EmbeddingUsage(prompt_tokens=done.prompt_tokens, total_tokens=done.prompt_tokens)
    out = EmbeddingList(data=data, model=body.model, usage=usage)
    return Response(out.model_dump_json(), media_type="application/json", headers={"x-request-id": done.request_id})


def _encoded(vector: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":  # what the openai client asks for by default: float32, little-endian
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return [float(x) for x in vector]
