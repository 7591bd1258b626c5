"""`POST /v1/embeddings`: vectors for texts (or token ids), metered like any request.

    in-process  `minilm` (also `all-MiniLM-L6-v2`): the gateway's own sentence embedder (core.embedder, the one
                the semantic cache and the router use), 384 dimensions, unit length, 256 word pieces per input
    remote      a remote tier's name: its server's `/v1/embeddings`, with the tier's `remote_model`

A request passes the tenant's policy (the tier must be allowed), reserves its worst case against budgets and
rate limits, and writes one ledger row (`endpoint = "embeddings"`, prompt tokens only) priced at the tier's
prompt price; its counterfactual is its cost (no lever of the gateway makes an embedding cheaper). Refused with a
400 naming the field: an input longer than the model takes (`input[i]`; never silently truncated), token ids
outside its vocabulary, `dimensions` the model does not have.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING

import anyio
import numpy as np

from core.embedder import Embedder
from engines.remote.engine import RemoteEngine
from gateway.accounting.record import Decisions, TokenCounts, UsageRecord
from gateway.accounting.tenants import Principal
from gateway.http.errors import APIError, from_budget, invalid
from gateway.http.schemas import EmbeddingRequest
from gateway.pipeline.aliases import EMBEDDING_TIER, resolve
from gateway.pipeline.refusals import model_not_allowed
from policies.budgets import BudgetError, Reservation
from policies.policy import PER_MILLION
from policies.pricing import Charge
from policies.store import Versioned

if TYPE_CHECKING:
    from gateway.pipeline import Pipeline

TIER = EMBEDDING_TIER
NAMES = frozenset({TIER, "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"})
CHECKPOINT = "all-MiniLM-L6-v2"


@dataclass(frozen=True)
class _Run:
    """What one embedding request ran, for its ledger row."""

    request_id: str
    principal: Principal
    policy: Versioned
    tier: str
    remote: RemoteEngine | None
    tokens: int
    status: str
    started: float
    asked: str  # the model name the client sent


@dataclass(frozen=True)
class Embedded:
    request_id: str
    vectors: np.ndarray  # (inputs, dimensions) float32
    prompt_tokens: int


class Embeddings:
    """Embeds for the pipeline's tenants (`Pipeline.embeddings`)."""

    def __init__(self, pipeline: Pipeline, embedder: Embedder | None = None) -> None:
        self.pipeline = pipeline
        self.embedder = embedder or Embedder()

    def remote(self, model: str) -> RemoteEngine | None:
        engine = self.pipeline.engines.get(model)
        return engine if isinstance(engine, RemoteEngine) else None

    async def embed(self, principal: Principal, body: EmbeddingRequest) -> Embedded:
        policy = await self.pipeline.policy(principal)
        model = resolve(policy.policy, self.pipeline.settings.model_aliases, body.model)
        remote = self.remote(model)
        if model not in NAMES and remote is None:
            raise self._unknown(body.model)
        tier = TIER if remote is None else model
        if not policy.policy.allows(tier):
            raise model_not_allowed(tier, [t for t in [TIER, *self.pipeline.engines] if policy.policy.allows(t)])
        if remote is None and body.dimensions not in (None, Embedder.DIM):
            raise invalid(f"`{CHECKPOINT}` has {Embedder.DIM} dimensions and cannot shorten them.", param="dimensions")
        texts, counts = await anyio.to_thread.run_sync(self._texts, body, remote)
        request_id = f"embd-{uuid.uuid4().hex}"
        price = policy.policy.price(tier).prompt
        worst = sum(counts) * price / PER_MILLION
        try:
            reservation = await self.pipeline.budgets.admit(
                request_id, policy.policy, principal.tenant_id, principal.key_id, worst, sum(counts)
            )
        except BudgetError as exc:
            raise from_budget(exc) from exc
        started, status, tokens = time.perf_counter(), "error", 0
        try:
            if remote is None:
                vectors = await anyio.to_thread.run_sync(self.embedder.encode, texts)
                tokens = sum(counts)
            else:
                vectors, tokens = await remote.embed(texts, body.dimensions)
                tokens = tokens or sum(counts)
            status = "ok"
            return Embedded(request_id, vectors, tokens)
        finally:
            with anyio.CancelScope(shield=True):
                run = _Run(request_id, principal, policy, tier, remote, tokens, status, started, body.model)
                await self._bill(run, reservation)

    def _texts(self, body: EmbeddingRequest, remote: RemoteEngine | None) -> tuple[list[str], list[int]]:
        """The inputs as texts, and each one's token count (the model's own tokenizer; a remote tier's ids and
        counts are its tier tokenizer's)."""
        items = [body.input] if isinstance(body.input, str) or _is_ids(body.input) else list(body.input)
        if remote is not None:
            tok = remote.tokenizer
            texts = [t if isinstance(t, str) else tok.decode(list(t)) for t in items]
            counts = [len(tok.encode(t, add_special_tokens=False)) if isinstance(t, str) else len(t) for t in items]
            return texts, counts
        tokenizer = self.embedder.tokenizer()
        vocab, limit = len(tokenizer), self.embedder.max_tokens()
        texts, counts = [], []
        for i, item in enumerate(items):
            if isinstance(item, str):
                text, n = item, len(tokenizer(item, add_special_tokens=False)["input_ids"])
            else:
                if any(not 0 <= t < vocab for t in item):
                    raise invalid(f"Token ids must lie in [0, {vocab}) for `{CHECKPOINT}`.", param=f"input[{i}]")
                text, n = tokenizer.decode(list(item)), len(item)
            if n + 2 > limit:  # [CLS] and [SEP] take two of the model's positions
                raise invalid(f"`{CHECKPOINT}` takes at most {limit - 2} tokens per input; input {i} has {n}.",
                              param=f"input[{i}]")  # fmt: skip
            texts.append(text)
            counts.append(n)
        return texts, counts

    async def _bill(self, run: _Run, reservation: Reservation) -> None:
        """One ledger row, whatever happened (an error bills the tokens the remote reported: usually none)."""
        cost = run.tokens * run.policy.policy.price(run.tier).prompt / PER_MILLION
        seconds = time.perf_counter() - run.started
        rec = UsageRecord(
            request_id=run.request_id,
            tenant_id=run.principal.tenant_id,
            api_key_id=run.principal.key_id,
            endpoint="embeddings",
            model=(run.remote.config.embedding_model or run.remote.config.model) if run.remote else CHECKPOINT,
            tier=run.tier,
            latency_ms=round(seconds * 1000),
            status=run.status,
            finish_reason="stop" if run.status == "ok" else "error",
            tokens=TokenCounts(prompt=run.tokens, completion=0),
            decisions=Decisions(cache_status="bypass", policy_version=run.policy.version),
            charge=Charge(cost=cost, counterfactual=cost),
            requested_model=run.asked,
        )
        pipeline = self.pipeline
        if pipeline.metrics is not None:
            pipeline.metrics.record_request(rec, None, seconds)
        await pipeline.ledger.write(rec)
        await pipeline.budgets.settle(reservation, Decimal(cost), run.tokens)

    def _unknown(self, model: str) -> APIError:
        offered = sorted([TIER, *(name for name, e in self.pipeline.engines.items() if isinstance(e, RemoteEngine))])
        return APIError(404, f"`{model}` is not an embedding model here; embedding models: {', '.join(offered)}.",
                        param="model", code="model_not_found")  # fmt: skip


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, int) for x in value)
