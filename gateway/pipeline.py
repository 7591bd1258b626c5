"""The request pipeline: one path from a validated API request to engine outputs and a usage row.

    start()   the tenant's policy (allowed tiers, sampling clamps), the prompts, every limit, then the
              budget and rate-limit reservation of the worst case  → 4xx/429 before anything runs
    events()  run the engine requests and stream choice deltas; price what ran, write one ledger row
              and settle the reservation, exactly once, however the stream ends (finished, client
              gone, engine error)

Later stages (normalization, the response cache, routing, verifiers) slot in here, so the API
routes stay thin translators between HTTP and this module.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, TypeVar

import anyio

from engines.async_engine import AsyncEngine, EngineUnavailable
from engines.engine import RequestRejected
from engines.request import EngineRequest, FinishReason, RequestOutput
from engines.sampling import SamplingParams
from engines.tokenizer import ChatTemplateError, Tokenizer
from gateway.cache_stage import BYPASS, CacheDecision, CacheStage, cache_mode
from gateway.errors import APIError, invalid
from gateway.ledger import Ledger, UsageRecord
from gateway.metrics import Metrics
from gateway.schemas import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
)
from gateway.settings import Settings
from gateway.tenants import Principal
from policies.budgets import Budgets, Reservation
from policies.policy import Policy
from policies.pricing import Tokens, charge, worst_case
from policies.store import PolicyStore, Versioned


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    text: str
    finish_reason: str | None  # set on a choice's last delta


@dataclass
class Generation:
    """A request that passed every check; iterate `events()` to run it."""

    request_id: str
    endpoint: str
    model: str
    principal: Principal
    engine: AsyncEngine
    requests: list[EngineRequest]  # one per choice, in choice order
    prompt_tokens: int  # each distinct prompt counted once, as OpenAI bills n > 1
    ledger: Ledger
    budgets: Budgets
    policy: Versioned
    reservation: Reservation
    tier_model: str  # the checkpoint behind the tier, for the ledger
    requested_max: list[int]  # per choice: what the request asked for (or its room), before the policy cap
    requested_max_tokens: int | None  # as sent
    num_prompts: int = 1
    cache: CacheDecision = BYPASS
    cache_stage: CacheStage | None = None
    metrics: Metrics | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
    status: str = "pending"
    charged: bool = False
    ttft: float | None = None  # seconds from start to the first generated text (engine runs only)

    @property
    def num_choices(self) -> int:
        return len(self.requests)

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )

    async def events(self) -> AsyncIterator[ChoiceDelta]:
        if self.status != "pending":
            raise RuntimeError("a generation runs once")
        self.status = "running"
        started = time.perf_counter()
        if self.cache.answer is not None:
            async for delta in self._replay(started):
                yield delta
            return
        index = {r.request_id: i for i, r in enumerate(self.requests)}
        reasons: list[str | None] = [None] * len(self.requests)
        texts = [""] * len(self.requests)
        try:
            stream = self.engine.open(self.requests)
        except EngineUnavailable:  # stopped between start() and now: nothing ran, nothing to record
            await self._release()
            raise _unavailable(self.model) from None
        try:
            async for out in stream:
                self.completion_tokens = sum(o.completion_tokens for o in stream.last.values())
                if out.finish_reason is FinishReason.ERROR:
                    raise APIError(500, "The engine failed while generating; please retry.", code="engine_error")
                i = index[out.request_id]
                reasons[i] = out.finish_reason.value if out.finish_reason else None
                texts[i] += out.text
                if out.text and self.ttft is None:
                    self.ttft = time.perf_counter() - started
                if out.text or reasons[i]:
                    yield ChoiceDelta(i, out.text, reasons[i])
            # the engine aborts what is left when it shuts down under a running request
            self.status = "aborted" if FinishReason.ABORT.value in reasons else "ok"
        except (asyncio.CancelledError, GeneratorExit):
            self.status = "aborted"
            raise
        except BaseException:
            self.status = "error"
            raise
        finally:
            # Shielded: a cancelled request must still be aborted, counted to its last generated
            # token (tokens still queued for a departed client included), priced and written down.
            with anyio.CancelScope(shield=True):
                await stream.aclose()
                self.completion_tokens = sum(o.completion_tokens for o in stream.last.values())
                await self._account(stream.last, reasons, time.perf_counter() - started)
                if self.status == "ok" and self.cache_stage is not None and self.cache.key is not None:
                    usage = (self.prompt_tokens, self.completion_tokens)
                    await self.cache_stage.store(
                        self.principal.tenant_id, self.cache, texts, reasons, usage, self.model, self.request_id
                    )

    REPLAY_CHARS = 24  # a cached answer streams in pieces of about this many characters, like a generation

    async def _replay(self, started: float) -> AsyncIterator[ChoiceDelta]:
        """Answer from the cache: the stored texts as choice deltas; billed as a cache hit."""
        answer = self.cache.answer
        assert answer is not None
        self.completion_tokens = answer.completion_tokens
        try:
            for i, (text, reason) in enumerate(zip(answer.texts, answer.finish_reasons, strict=True)):
                pieces = [text[j : j + self.REPLAY_CHARS] for j in range(0, len(text), self.REPLAY_CHARS)] or [""]
                for j, piece in enumerate(pieces):
                    yield ChoiceDelta(i, piece, reason if j == len(pieces) - 1 else None)
            self.status = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            self.status = "aborted"
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._account({}, list(answer.finish_reasons), time.perf_counter() - started)

    async def _account(self, last: Mapping[str, RequestOutput], reasons: list[str | None], seconds: float) -> None:
        """Price what ran, write its ledger row, then settle the reservation to the actual cost."""
        outs = [last.get(r.request_id) for r in self.requests]
        cached = 0  # each distinct prompt billed once: its least-cached choice
        for first in range(0, len(outs), self._choices_per_prompt):
            group = outs[first : first + self._choices_per_prompt]
            cached += min((o.cached_tokens if o else 0) for o in group)
        cut = 0  # completion tokens the policy's cap stopped: choices that ran into it
        for r, o, asked, reason in zip(self.requests, outs, self.requested_max, reasons, strict=True):
            if o is not None and reason == "length" and asked > r.params.max_tokens == o.completion_tokens:
                cut += asked - r.params.max_tokens
        tokens = Tokens(
            prompt=self.prompt_tokens,
            completion=self.completion_tokens,
            cached_prompt=cached,
            draft_accepted=sum(o.draft_accepted for o in outs if o),
            policy_cut=cut,
            cache_hit=self.cache.answer is not None,
        )
        price = charge(self.policy.policy, self.model, tokens)
        rec = UsageRecord(
            request_id=self.request_id,
            tenant_id=self.principal.tenant_id,
            api_key_id=self.principal.key_id,
            endpoint=self.endpoint,
            model=self.tier_model,
            tier=self.model,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            latency_ms=round(seconds * 1000),
            status=self.status,
            finish_reason="abort" if self.status == "aborted" else reasons[0],
            cached_prompt_tokens=cached,
            draft_proposed=sum(o.draft_proposed for o in outs if o),
            draft_accepted=tokens.draft_accepted,
            requested_max_tokens=self.requested_max_tokens,
            effective_max_tokens=self.requests[0].params.max_tokens,
            policy_version=self.policy.version,
            cache_status=self.cache.status,
            cost=price.cost,
            counterfactual_cost=price.counterfactual,
            saved_cache=price.saved_cache,
            saved_routing=price.saved_routing,
            saved_speculation=price.saved_speculation,
            saved_verifier=price.saved_verifier,
            saved_policy=price.saved_policy,
        )
        self.charged = True
        if self.metrics is not None:
            self.metrics.record_request(rec, self.ttft, seconds)
        await self.ledger.write(rec)  # group-committed with concurrent requests' rows
        await self.budgets.settle(self.reservation, price.cost, tokens.prompt + tokens.completion)

    @property
    def _choices_per_prompt(self) -> int:
        return max(1, len(self.requests) // max(1, self.num_prompts))

    async def abandon(self) -> None:
        """Give back the reservation of a generation that never ran (its client left first)."""
        if self.status == "pending" and not self.charged:
            self.status = "abandoned"
            await self._release()

    async def _release(self) -> None:
        """Settle the reservation to nothing: the request never ran."""
        self.charged = True
        with anyio.CancelScope(shield=True):
            await self.budgets.settle(self.reservation, Decimal(0), 0)


class Pipeline:
    def __init__(
        self,
        engines: Mapping[str, AsyncEngine],
        ledger: Ledger,
        settings: Settings,
        policies: PolicyStore,
        budgets: Budgets,
        cache: CacheStage | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.engines = dict(engines)
        self.ledger = ledger
        self.settings = settings
        self.policies = policies
        self.budgets = budgets
        self.cache = cache
        self.metrics = metrics

    async def policy(self, principal: Principal) -> Versioned:
        if (hit := self.policies.cached(principal.tenant_id)) is not None:
            return hit  # the common case: no thread hop
        return await anyio.to_thread.run_sync(self.policies.current, principal.tenant_id)

    def engine(self, model: str, policy: Policy) -> AsyncEngine:
        engine = self.engines.get(model)
        if engine is None:
            raise model_not_found(model)
        if not policy.allows(model):
            raise APIError(
                403,
                f"Your tenant's policy does not allow the model `{model}`; allowed: "
                f"{', '.join(t for t in self.engines if policy.allows(t)) or 'none'}.",
                code="model_not_allowed",
                param="model",
            )
        if not engine.alive:
            raise _unavailable(model)
        return engine

    async def start_chat(
        self, principal: Principal, body: ChatCompletionRequest, cache_header: str | None = None
    ) -> Generation:
        policy = await self.policy(principal)
        engine = self.engine(body.model, policy.policy)
        _reject_unsupported(body, UNSUPPORTED_CHAT)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = await _tokenize(sum(len(m["content"]) for m in messages), engine.tokenizer.encode_chat, messages)
        except ChatTemplateError as exc:
            raise invalid(str(exc), param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self._generation(
            "chat.completions", "chatcmpl", principal, policy, body, engine, [prompt], max_tokens,
            messages, cache_header,
        )  # fmt: skip

    async def start_completion(
        self, principal: Principal, body: CompletionRequest, cache_header: str | None = None
    ) -> Generation:
        policy = await self.policy(principal)
        engine = self.engine(body.model, policy.policy)
        _reject_unsupported(body, UNSUPPORTED_COMPLETION)
        size = len(body.prompt) if isinstance(body.prompt, str) else INLINE_TOKENIZE_CHARS  # lists: off the loop
        prompts = await _tokenize(size, _completion_prompts, body.prompt, engine.tokenizer)
        return await self._generation(
            "completions", "cmpl", principal, policy, body, engine, prompts, body.max_tokens, body.prompt, cache_header
        )

    async def _generation(
        self,
        endpoint: str,
        id_prefix: str,
        principal: Principal,
        policy: Versioned,
        body: ChatCompletionRequest | CompletionRequest,
        engine: AsyncEngine,
        prompts: list[list[int]],
        max_tokens: int | None,
        conversation: Any,
        cache_header: str | None,
    ) -> Generation:
        if body.n * len(prompts) > self.settings.max_n:
            raise invalid(f"at most {self.settings.max_n} choices per request (n × prompts)", param="n")
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        # Cached prompt prefixes are shared within a tenant only, unless configured otherwise: a
        # faster first token would tell one tenant what another tenant's prompts begin with.
        salt = f"tenant:{principal.tenant_id}" if self.settings.prefix_cache_scope == "tenant" else ""
        requests, asked = [], []
        for p, prompt in enumerate(prompts):
            params, wanted = self._params(body, engine, prompt, max_tokens, policy.policy)
            for j in range(body.n):
                seeded = params if params.seed is None else replace(params, seed=params.seed + j)
                requests.append(EngineRequest(f"{request_id}-{p * body.n + j}", prompt, seeded, cache_salt=salt))
                asked.append(wanted)
        prompt_tokens = sum(len(p) for p in prompts)
        completion_max = sum(r.params.max_tokens for r in requests)
        cache = BYPASS
        if self.cache is not None:
            mode = cache_mode(body.model_extra, cache_header)
            cache = await self.cache.lookup(
                principal.tenant_id, policy.policy.cache, mode, endpoint, body.model, conversation,
                _answer_params(body, requests[0].params),
            )  # fmt: skip
        worst_money = worst_case(policy.policy, body.model, prompt_tokens, completion_max)
        if cache.answer is not None:  # a hit costs nothing; rate limits still count it
            worst_money, prompt_tokens_worst, completion_max = Decimal(0), 0, 0
        else:
            prompt_tokens_worst = prompt_tokens
        reservation = await self.budgets.admit(
            request_id,
            policy.policy,
            principal.tenant_id,
            principal.key_id,
            worst_money,
            prompt_tokens_worst + completion_max,
        )
        tier = self.settings.tiers.get(body.model)
        return Generation(
            request_id=request_id,
            endpoint=endpoint,
            model=body.model,
            principal=principal,
            engine=engine,
            requests=requests,
            prompt_tokens=prompt_tokens,
            ledger=self.ledger,
            budgets=self.budgets,
            policy=policy,
            reservation=reservation,
            tier_model=tier.model if tier else body.model,
            requested_max=asked,
            requested_max_tokens=max_tokens,
            num_prompts=len(prompts),
            cache=cache,
            cache_stage=self.cache,
            metrics=self.metrics,
        )

    def _params(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        engine: AsyncEngine,
        prompt: list[int],
        max_tokens: int | None,
        policy: Policy,
    ) -> tuple[SamplingParams, int]:
        """The engine's sampling parameters after the policy's clamps, and the max tokens asked for."""
        room = engine.max_model_len - len(prompt)
        if max_tokens is None:
            max_tokens = min(room, self.settings.default_max_tokens or room)
            max_tokens = max(max_tokens, 1)  # no room left: the context check below explains
        wanted = max_tokens
        limits = policy.sampling
        if limits.max_tokens_cap is not None:
            max_tokens = min(max_tokens, limits.max_tokens_cap)
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        if limits.temperature_max is not None:
            temperature = min(temperature, limits.temperature_max)
        if limits.top_p_max is not None:
            top_p = min(top_p, limits.top_p_max)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=body.top_k or 0,
                seed=body.seed,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                stop=tuple(body.stop_list or limits.default_stop),
            )
            engine.check(prompt, params.max_tokens)
        except RequestRejected as exc:
            param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            raise invalid(str(exc), param=param, code=exc.code) from None
        except ValueError as exc:
            raise invalid(str(exc)) from None
        return params, min(wanted, max(room, 1))


# Request fields that change the answer, besides the sampling parameters: part of the cache key.
_ANSWER_FIELDS = ("tools", "tool_choice", "functions", "response_format", "logit_bias", "logprobs", "top_logprobs")


def _answer_params(body: ChatCompletionRequest | CompletionRequest, params: SamplingParams) -> dict[str, Any]:
    """What the cache must key on, after the policy's clamps (so a clamp cannot hand back another's answer)."""
    extra = body.model_extra or {}
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_tokens": params.max_tokens,
        "stop": list(params.stop),
        "seed": body.seed,
        "n": body.n,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        **{k: extra[k] for k in _ANSWER_FIELDS if extra.get(k) is not None},
    }


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def _unavailable(model: str) -> APIError:
    return APIError(503, f"The model `{model}` is not serving right now; retry shortly.", code="engine_unavailable")


def _reject_unsupported(body: ChatCompletionRequest | CompletionRequest, names: tuple[str, ...]) -> None:
    if name := body.unsupported(names):
        raise invalid(f"`{name}` is not supported by this server yet.", param=name, code="unsupported_parameter")


T = TypeVar("T")

# Shorter prompts tokenize in well under a millisecond, cheaper on the event loop than a hand-off to a
# worker thread (~0.14 ms); longer ones go to a thread so the loop keeps serving others meanwhile.
INLINE_TOKENIZE_CHARS = 2048


async def _tokenize(chars: int, fn: Callable[..., T], *args: Any) -> T:
    if chars < INLINE_TOKENIZE_CHARS:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args)


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
