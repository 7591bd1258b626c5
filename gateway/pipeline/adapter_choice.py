"""Which LoRA adapter a request runs under, and getting it onto the engine first.

    `model: "small:NAME"`   the tenant's adapter NAME on tier small; another tenant's, or one never registered, is
                            a 404 `model_not_found`, exactly as an unknown model is (its existence is not told)
    `model: "small"`        the policy's default adapter for small (`Policy.adapters`), if it names one; routed
    `model: "auto"`         requests that the router sends to small get it too; a default since deleted serves the
                            base model, logged
    anything else           no adapter

An adapter request is served by its tier's engine only (a fallback tier holds no such adapter), keyed in the
response cache by the adapter's digest, and its ledger row names the checkpoint with the adapter (`+NAME`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TypeVar

import anyio

from engines.async_engine import AsyncEngine
from engines.lora import AdapterError
from engines.protocol import TierEngine
from gateway.accounting.tenants import Principal
from gateway.adapters import AdapterLoader, AdapterRecord, AdapterStore, split_model
from gateway.http.errors import APIError, invalid
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from gateway.pipeline.refusals import model_not_found
from policies.policy import Policy

__all__ = ["AdapterChoice", "cache_tier", "ledger_model"]

log = logging.getLogger(__name__)
B = TypeVar("B", ChatCompletionRequest, CompletionRequest)
LEDGER_MODEL_CHARS = 100  # the usage table's model column


def cache_tier(tier: str, adapter: AdapterRecord | None) -> str:
    """What the response cache keys an answer's tier as: the adapter's files are part of what answered."""
    return tier if adapter is None else f"{tier}:{adapter.name}@{adapter.digest}"


def ledger_model(checkpoint: str, adapter: AdapterRecord | None) -> str:
    return checkpoint if adapter is None else f"{checkpoint}+{adapter.name}"[:LEDGER_MODEL_CHARS]


class AdapterChoice:
    def __init__(self, store: AdapterStore | None, engines: Mapping[str, TierEngine]) -> None:
        self.store = store
        self.engines = engines
        self.tiers = list(engines)
        self.loader = AdapterLoader()

    async def named(self, principal: Principal, body: B) -> tuple[B, AdapterRecord | None]:
        """`body` naming the bare tier, and the adapter its model named (404 if the tenant has none such)."""
        tier, name = split_model(body.model, self.tiers)
        if name is None:
            return body, None
        record = await self._find(principal.tenant_id, tier, name)
        if record is None:
            raise model_not_found(body.model)
        return body.model_copy(update={"model": tier}), record

    async def default(self, principal: Principal, policy: Policy, tier: str) -> AdapterRecord | None:
        """The adapter the tenant's policy serves `tier` under, if any (and still registered)."""
        name = policy.adapters.get(tier)
        if name is None:
            return None
        record = await self._find(principal.tenant_id, tier, name)
        if record is None:
            log.warning("tenant %s: default adapter %s:%s is not registered; serving the base", principal.tenant_name,
                        tier, name)  # fmt: skip
        return record

    def served(self, engine: TierEngine, record: AdapterRecord) -> str:
        """The name `engine` serves `record` under (nothing loaded yet); a 400 on a remote tier."""
        if not isinstance(engine, AsyncEngine):
            raise invalid(f"Tier `{record.tier}` is served by a remote server here: it runs no adapters.",
                          param="model", code="unsupported_parameter")  # fmt: skip
        return record.key

    async def load(self, engine: TierEngine, record: AdapterRecord) -> str:
        """The engine's name for `record`, loaded if needed: a 400 on a remote tier, a 503 when it cannot be."""
        self.served(engine, record)
        assert isinstance(engine, AsyncEngine)
        try:
            return await self.loader.ensure(engine, record)
        except AdapterError as exc:
            raise APIError(503, f"The adapter `{record.model}` cannot be served right now: {exc}",
                           code="adapter_unavailable") from None  # fmt: skip

    async def key_for(self, tenant_id: int, tier: str, name: str) -> str | None:
        """The engine's name for the tenant's adapter `name` on `tier`, loaded; None where it is gone or cannot be
        served now (what explore runs ask: `gateway.routing.explore`)."""
        record = await self._find(tenant_id, tier, name)
        engine = self.engines.get(tier)
        if record is None or engine is None:
            return None
        try:
            return await self.load(engine, record)
        except APIError:
            return None

    async def missing(self, tenant_id: int, policy: Policy) -> list[tuple[tuple[str, ...], str]]:
        """(field path, message) for each default adapter the policy names that the tenant has not registered."""
        problems = []
        for tier, name in policy.adapters.items():
            if await self._find(tenant_id, tier, name, cached=False) is None:
                problems.append((("adapters", tier), f"the tenant has no adapter {name!r} on tier {tier!r}"))
        return problems

    async def _find(self, tenant_id: int, tier: str, name: str, cached: bool = True) -> AdapterRecord | None:
        if self.store is None:
            return None
        hit, record = self.store.peek(tenant_id, tier, name) if cached else (False, None)
        if hit:
            return record
        return await anyio.to_thread.run_sync(self.store.find, tenant_id, tier, name, cached)
