"""The pipeline's cache stage: decide per request whether to answer from the response cache, and
store what the engines answered.

    miss      cacheable, not found: run it, then store the answer
    hit       the normalized request's exact key was found
    semantic-hit  a stored request close enough in meaning (MiniLM), with identical parameters and no
              difference in numbers, negation, entities or quoted strings, was found
    bypass    not cacheable (sampling without a seed, the tenant's policy) or the client said
              `cache: "no-cache"` (don't read; store) or `"no-store"` (neither)
    flight-hit, flight-sem-hit  a miss whose answer another request of the tenant was generating right
              then, exactly or semantically the same: served that answer as a hit
              (`gateway.pipeline.single_flight`); the header says `hit` or `semantic-hit`

A cache that cannot be reached is a miss: the request runs (the caches never raise).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.cache.exact import CachedAnswer, ResponseCache
from gateway.cache.normalize import CacheKey, is_deterministic, request_key
from gateway.cache.semantic import SemanticCache
from gateway.http.errors import invalid
from policies.policy import CacheSettings

Mode = Literal["default", "no-cache", "no-store"]
MODES = ("default", "no-cache", "no-store")


@dataclass(frozen=True)
class CacheDecision:
    status: str  # hit | semantic-hit | miss | bypass | flight-hit | flight-sem-hit
    key: CacheKey | None = None  # set when the answer may be stored
    answer: CachedAnswer | None = None  # set on a hit
    similarity: float | None = None
    settings: CacheSettings | None = None

    @property
    def header(self) -> str:
        """`x-switchboard-cache`: a single-flight follower's answer is a hit like any other; its row says more."""
        return _HEADERS.get(self.status, self.status)


BYPASS = CacheDecision("bypass")
_HEADERS = {"bypass": "miss", "flight-hit": "hit", "flight-sem-hit": "semantic-hit"}


def cache_mode(extra: Mapping[str, Any] | None, header: str | None) -> Mode:
    """The client's cache control: the body's `cache` field, else the `x-switchboard-cache-control` header."""
    value = (extra or {}).get("cache", header)
    if value is None:
        return "default"
    if value not in MODES:
        raise invalid(f"`cache` must be one of {', '.join(MODES)}", param="cache", code="invalid_value")
    return value  # type: ignore[return-value]


class CacheStage:
    def __init__(self, exact: ResponseCache, semantic: SemanticCache | None) -> None:
        self.exact = exact
        self.semantic = semantic

    async def lookup(
        self,
        tenant_id: int,
        settings: CacheSettings,
        mode: Mode,
        endpoint: str,
        tier: str,
        conversation: Any,
        params: Mapping[str, Any],
    ) -> CacheDecision:
        deterministic = is_deterministic(params.get("temperature"), params.get("seed"))
        if not settings.enabled or mode == "no-store" or (settings.deterministic_only and not deterministic):
            return BYPASS
        key = request_key(endpoint, tier, conversation, params, settings)
        if mode == "no-cache":
            return CacheDecision("bypass", key=key, settings=settings)
        if (answer := await self.exact.get(tenant_id, key.key)) is not None:
            return CacheDecision("hit", key=None, answer=answer, settings=settings)
        if settings.semantic and self.semantic is not None:
            found = await self.semantic.lookup(tenant_id, key, settings.semantic_threshold)
            if found is not None and (answer := await self.exact.get(tenant_id, found[0])) is not None:
                return CacheDecision("semantic-hit", answer=answer, similarity=found[1], settings=settings)
        return CacheDecision("miss", key=key, settings=settings)

    async def store(self, tenant_id: int, decision: CacheDecision, answer: CachedAnswer) -> None:
        if decision.key is None or decision.settings is None:
            return
        s = decision.settings
        await self.exact.put(tenant_id, decision.key.key, answer, s.ttl_seconds, s.max_entries)
        if s.semantic and self.semantic is not None:
            await self.semantic.add(tenant_id, decision.key, s.ttl_seconds)

    async def close(self) -> None:
        await self.exact.close()
        if self.semantic is not None:
            await self.semantic.close()
