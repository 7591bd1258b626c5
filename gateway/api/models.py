"""`GET /v1/models` and `GET /v1/models/{model}`: the tiers this tenant's policy allows, and `auto` (the router
picks) where a router is loaded."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api.auth import CurrentPrincipal
from gateway.api.deps import PipelineDep, StartedDep
from gateway.http.errors import documented
from gateway.http.schemas import ModelCard, ModelList
from gateway.pipeline import model_not_found
from gateway.routing.stage import AUTO

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["openai"], responses=documented(400, 401, 413, 503))


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
