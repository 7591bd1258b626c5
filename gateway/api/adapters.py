"""Admin endpoints for a tenant's LoRA adapters (keys with the `admin` role; the operator's reach every tenant):

    GET    /v1/admin/tenants/{tenant}/adapters                list them
    POST   /v1/admin/tenants/{tenant}/adapters                upload one (multipart: `tier`, `name`, `replace`,
                                                              `config` = adapter_config.json,
                                                              `weights` = adapter_model.safetensors)
    DELETE /v1/admin/tenants/{tenant}/adapters/{tier}/{name}  remove one

An upload is checked against the tier's loaded model before anything is kept (`gateway.adapters.store`): files
that are not a servable PEFT LoRA adapter for that model are a 400 naming why, and nothing is stored or loaded. The
adapter is then `model: "<tier>:<name>"` for that tenant's keys, and only theirs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import anyio
from fastapi import APIRouter, File, Form, UploadFile
from pydantic import BaseModel

from engines.async_engine import AsyncEngine
from engines.lora import CONFIG, WEIGHTS, AdapterError, LoraAdapter, load_adapter
from gateway.adapters import ADAPTER_NAME, AdapterConflict, AdapterRecord, AdapterStore, UnknownAdapter
from gateway.adapters.policy import forget_learning_if_default
from gateway.api.auth import AdminPrincipal, visible_tenant
from gateway.api.deps import DatabaseDep, PipelineDep, PolicyStoreDep
from gateway.api.params import AdapterName, TenantName, TierName
from gateway.http.errors import APIError, documented, invalid
from gateway.pipeline import Pipeline

__all__ = ["ADAPTERS_UPLOAD_PATH", "router"]

router = APIRouter(prefix="/v1/admin/tenants/{tenant}/adapters", tags=["admin"],
                   responses=documented(400, 401, 403, 404, 413, 422, 503))  # fmt: skip
ADAPTERS_UPLOAD_PATH = r"/v1/admin/tenants/[^/]+/adapters"  # its body limit is `max_adapter_bytes`
CHUNK = 1 << 20


class AdapterOut(BaseModel):
    tier: str
    name: str
    model: str
    digest: str
    rank: int
    size_bytes: int
    source: str
    created_by: str
    created_at: str
    details: dict


def _out(record: AdapterRecord) -> AdapterOut:
    return AdapterOut(**record.as_dict())


def _store(pipeline: Pipeline) -> AdapterStore:
    """The gateway's adapter store, or a 503 where it keeps none (an app built without one)."""
    store = pipeline.adapters.store
    if store is None:
        raise APIError(503, "This gateway keeps no adapters.", code="adapters_unavailable")
    return store


@router.get("", response_model=list[AdapterOut])
async def list_adapters(
    tenant: TenantName, db: DatabaseDep, pipeline: PipelineDep, principal: AdminPrincipal
) -> list[AdapterOut]:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    return [_out(r) for r in await anyio.to_thread.run_sync(_store(pipeline).list, t.id)]


@router.post("", response_model=AdapterOut, status_code=201, responses=documented(409))
async def upload(
    tenant: TenantName,
    db: DatabaseDep,
    pipeline: PipelineDep,
    policies: PolicyStoreDep,
    principal: AdminPrincipal,
    tier: Annotated[str, Form(description="the tier whose model it adapts")],
    name: Annotated[str, Form(description="requests name it `<tier>:<name>`")],
    config: Annotated[UploadFile, File(description=CONFIG)],
    weights: Annotated[UploadFile, File(description=WEIGHTS)],
    replace: Annotated[bool, Form(description="replace the tenant's adapter of this name")] = False,
) -> AdapterOut:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    store = _store(pipeline)
    engine = pipeline.engines.get(tier)
    if engine is None:
        raise invalid(f"No tier named {tier!r}; served: {', '.join(pipeline.engines)}.", param="tier")
    if not isinstance(engine, AsyncEngine):
        raise invalid(f"Tier {tier!r} is served by a remote server here: it runs no adapters.", param="tier")
    if not ADAPTER_NAME.match(name):
        raise invalid("An adapter's name is lowercase letters, digits, '.', '_' and '-', at most 64.", param="name")
    model = engine.engine.model

    def check(folder: Path) -> LoraAdapter:
        return load_adapter(folder, model)  # the tensors are read and dropped: nothing is loaded on the engine

    store.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=store.root, prefix=".upload-") as tmp:
        for upload_file, file in ((config, CONFIG), (weights, WEIGHTS)):
            await _save(upload_file, Path(tmp) / file)
        try:
            record = await anyio.to_thread.run_sync(
                lambda: store.register(t.id, tier, name, Path(tmp), check, actor=principal.actor, replace=replace)
            )
        except AdapterError as exc:
            raise invalid(f"Not a servable adapter for tier {tier!r}: {exc}", param="weights",
                          code="invalid_adapter") from None  # fmt: skip
        except AdapterConflict as exc:
            raise APIError(409, str(exc), param="name", code="adapter_exists") from None
    if replace:  # the tenant's default tier changed under the same name: what its routing learned goes
        await anyio.to_thread.run_sync(lambda: forget_learning_if_default(policies, t.id, tier, name, principal.actor))
    return _out(record)


@router.delete("/{tier}/{name}", status_code=204)
async def delete(
    tenant: TenantName,
    tier: TierName,
    name: AdapterName,
    db: DatabaseDep,
    policies: PolicyStoreDep,
    pipeline: PipelineDep,
    principal: AdminPrincipal,
) -> None:
    t = await anyio.to_thread.run_sync(visible_tenant, db, principal, tenant)
    store = _store(pipeline)
    current = (await anyio.to_thread.run_sync(policies.current, t.id)).policy
    in_use = current.adapters.get(tier) == name
    try:
        record = await anyio.to_thread.run_sync(
            lambda: store.delete(t.id, tier, name, actor=principal.actor, in_use=in_use)
        )
    except UnknownAdapter as exc:
        raise APIError(404, str(exc), param="name", code="adapter_not_found") from None
    except AdapterConflict as exc:
        raise APIError(409, str(exc), param="name", code="adapter_in_use") from None
    engine = pipeline.engines.get(tier)
    if isinstance(engine, AsyncEngine):
        await pipeline.adapters.loader.drop(engine, record)


async def _save(upload: UploadFile, path: Path) -> None:
    """An uploaded file to disk in pieces (it may be hundreds of megabytes)."""
    with path.open("wb") as out:
        while chunk := await upload.read(CHUNK):
            await anyio.to_thread.run_sync(out.write, chunk)
