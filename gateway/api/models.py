"""`GET /v1/models` and `GET /v1/models/{model}`: the tiers this tenant's policy allows, `auto` (the router picks)
where a router is loaded, the aliases (the tenant's and the operator's) whose target the key may call, and the
tenant's own adapters on allowed tiers (`small:NAME`). The
same list answers Anthropic's clients (a key as `x-api-key` too; each card carries both APIs' fields)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter

from gateway.accounting.tenants import Principal
from gateway.api.auth import ApiKeyPrincipal
from gateway.api.deps import PipelineDep, StartedDep
from gateway.http.errors import documented
from gateway.http.schemas import ModelCard, ModelList
from gateway.pipeline import Pipeline, model_not_found
from gateway.pipeline.aliases import EMBEDDING_TIER, aliases
from gateway.routing.stage import AUTO

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["openai"], responses=documented(400, 401, 413, 503))


@router.get("/models", response_model=ModelList)
async def list_models(principal: ApiKeyPrincipal, pipeline: PipelineDep, created: StartedDep) -> ModelList:
    """The tiers this tenant's policy allows, and `auto` (the router picks) when a router is loaded."""
    return ModelList(data=[ModelCard(id=name, created=created) for name in await _callable(principal, pipeline)])


@router.get("/models/{model}", response_model=ModelCard, responses=documented(404))
async def get_model(model: str, principal: ApiKeyPrincipal, pipeline: PipelineDep, created: StartedDep) -> ModelCard:
    if model not in await _callable(principal, pipeline):
        raise model_not_found(model)
    return ModelCard(id=model, created=created)


async def _callable(principal: Principal, pipeline: Pipeline) -> list[str]:
    """What this key may name as `model`: the allowed tiers, `auto`, the embedding model, and aliases of them."""
    policy = (await pipeline.policy(principal)).policy
    names = [name for name in pipeline.engines if policy.allows(name)]
    if pipeline.routing.offered(policy):
        names.append(AUTO)
    targets = {*names, *([EMBEDDING_TIER] if policy.allows(EMBEDDING_TIER) else [])}
    names += [alias for alias, target in aliases(policy, pipeline.settings.model_aliases).items() if target in targets]
    if (store := pipeline.adapters.store) is not None:  # the tenant's adapters, `<tier>:<name>`, on allowed tiers
        own = await anyio.to_thread.run_sync(store.list, principal.tenant_id)
        names += [a.model for a in own if a.tier in pipeline.engines and policy.allows(a.tier)]
    return names
