"""The request pipeline: one path from a validated API request to engine outputs and a usage row.

    start()   the tenant's policy (allowed tiers, sampling clamps), the tier (`auto`: the router's
              choice, `gateway.routing`), the prompts, every limit, then the budget and rate-limit
              reservation of the worst case  → 4xx/429 before anything runs
    events()  run the engine requests on the requested tier, or on its fallback while it is down, and
              stream choice deltas; price what ran at the prices of the tier that served, write one
              ledger row and settle the reservation, exactly once, however the stream ends (finished,
              client gone, engine error)

Later stages (normalization, the response cache, routing, verifiers) slot in here, so the API
routes stay thin translators between HTTP and this module.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, TypeVar

import anyio

from core.settings import Settings
from engines.engine import RequestRejected
from engines.protocol import EngineUnavailable, OutputStream, TierEngine
from engines.request import EngineRequest, FinishReason, RequestOutput
from engines.sampling import SamplingParams
from engines.structured import Grammar, GrammarError
from engines.tokenizer import ChatTemplateError, Tokenizer
from gateway.cache_stage import BYPASS, CacheDecision, CacheStage, cache_mode
from gateway.errors import APIError, from_budget, invalid
from gateway.ledger import Ledger, UsageRecord
from gateway.metrics import Metrics
from gateway.prompt_log import log_exchange
from gateway.routing import RouteDecision, RoutingStage
from gateway.schemas import (
    MAX_SCHEMA_CHARS,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    Usage,
)
from gateway.tenants import Principal
from policies.budgets import BudgetError, Budgets, Reservation
from policies.policy import Policy
from policies.pricing import Charge, Tokens, charge, worst_case
from policies.sampling import Asked, instructed, resolve
from policies.store import PolicyStore, Versioned
from verifiers.base import Context
from verifiers.hook import VerifierHook
from verifiers.policy import build_verifiers
from verifiers.probe import AnswerProbe


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    text: str
    finish_reason: str | None  # set on a choice's last delta


@dataclass(frozen=True)
class Candidate:
    """A tier that may serve a request: the requested one, or a fallback."""

    name: str
    engine: TierEngine
    checkpoint: str  # the model behind the tier, for the ledger


@dataclass
class Generation:
    """A request that passed every check; iterate `events()` to run it."""

    request_id: str
    endpoint: str
    model: str  # the model asked for (a tier, or `auto`); responses name it whichever tier serves
    principal: Principal
    candidates: list[Candidate]  # who may serve, in order: the requested tier, then its fallbacks
    requests: list[EngineRequest]  # one per choice, in choice order
    prompt_tokens: int  # each distinct prompt counted once, as OpenAI bills n > 1
    ledger: Ledger
    budgets: Budgets
    policy: Versioned
    reservation: Reservation
    tier: str  # the tier that serves (a fallback when the requested one is down), for the ledger and prices
    tier_model: str  # the checkpoint behind it, for the ledger
    requested_max: list[int]  # per choice: what the request asked for (or its room), before the policy cap
    requested_max_tokens: int | None  # as sent
    num_prompts: int = 1
    cache: CacheDecision = BYPASS
    cache_stage: CacheStage | None = None
    metrics: Metrics | None = None
    route: RouteDecision | None = None  # set when the router chose the tier
    routing: RoutingStage | None = None
    conversations: list[Any] = field(default_factory=list)  # what the router decided on
    hooks: list[VerifierHook] = field(default_factory=list)  # the policy's verifiers, one per prompt
    cascade_to: str | None = None  # the tier a failed answer is retried on (the policy's cascade)
    escalation: str | None = None  # set once an answer failed: the caller retries it on this tier
    escalated_from: str | None = None  # this generation retries that request's failed answer
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
    status: str = "pending"
    charged: bool = False
    ttft: float | None = None  # seconds from start to the first generated text (engine runs only)
    texts: list[str] = field(default_factory=list, init=False, repr=False)  # each choice's text so far
    finish_reasons: list[str | None] = field(default_factory=list, init=False, repr=False)  # once accounted
    choice_tokens: list[int] = field(default_factory=list, init=False, repr=False)  # once accounted
    _stream: OutputStream | None = field(default=None, init=False, repr=False)  # once a tier took the requests
    _started: float | None = field(default=None, init=False, repr=False)
    _followed_up: bool = field(default=False, init=False, repr=False)  # after_response ran

    @property
    def num_choices(self) -> int:
        return len(self.requests)

    @property
    def verifier_actions(self) -> list[dict[str, Any]]:
        """What the verifiers did, choices numbered as in the response."""
        per_prompt = self._choices_per_prompt
        return [{**a, "choice": p * per_prompt + a["choice"]} for p, h in enumerate(self.hooks) for a in h.summary()]

    @property
    def wanted_tier(self) -> str:
        """The tier asked for, or the one the router chose: whose answers the cache keys hold."""
        return self.route.tier if self.route is not None else self.model

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
        started = self._started or time.perf_counter()
        if self.cache.answer is not None:
            async for delta in self._replay(started):
                yield delta
            return
        index = {r.request_id: i for i, r in enumerate(self.requests)}
        reasons: list[str | None] = [None] * len(self.requests)
        texts = self.texts = [""] * len(self.requests)
        try:
            stream = await self.begin()
            started = self._started or started
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
            # No stream: no tier took the requests (all down, or one refused them); `begin` settled.
            with anyio.CancelScope(shield=True):
                if self._stream is not None:
                    await self._settle_stream(reasons, started)
                # A fallback's answer is not the requested tier's: it is not cached under that tier's key.
                storable = self.status == "ok" and self.tier == self.wanted_tier and self.cache.key is not None
                if storable and self.cache_stage is not None:
                    usage = (self.prompt_tokens, self.completion_tokens)
                    await self.cache_stage.store(
                        self.principal.tenant_id, self.cache, texts, reasons, usage, self.tier, self.request_id
                    )

    async def begin(self) -> OutputStream:
        """Have the first candidate tier that can take the requests take them, and wait for its first output.

        A tier that is down, or fails before any output (a remote after its retries), passes the requests
        on to the next candidate. Streaming responses call this before their headers go out, so that
        `x-switchboard-tier` names the tier that serves and a refusal is still an HTTP error.
        """
        if self._stream is not None:
            return self._stream
        self._started = time.perf_counter()
        for i, candidate in enumerate(self.candidates):
            try:
                stream = candidate.engine.open(self.requests)
            except EngineUnavailable:  # stopped since start(): nothing ran here
                continue
            # Set before waiting: a client leaving meanwhile is billed for what ran, on this tier.
            self._stream, self.tier, self.tier_model = stream, candidate.name, candidate.checkpoint
            try:
                first = await anext(stream)
            except EngineUnavailable:
                first = None
            except RequestRejected as exc:  # a remote judged the request itself: the client's to fix
                await self._drop_stream()
                await self._release()
                raise invalid(str(exc), param=_prompt_param(self.endpoint), code=exc.code) from None
            last = i == len(self.candidates) - 1
            if first is not None and not (_failed_before_output(first) and not last):
                self._stream = _Primed(stream, first)
                return self._stream
            await self._drop_stream()
        await self._release()
        raise _unavailable(self.model)

    async def _drop_stream(self) -> None:
        """Close a stream that produced nothing; the next tier serves (and is billed) instead."""
        stream, self._stream = self._stream, None
        if stream is not None:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    async def _settle_stream(self, reasons: list[str | None], started: float) -> None:
        stream = self._stream
        assert stream is not None
        await stream.aclose()
        if self.status == "ok":  # final answer checks: tests can take seconds, so off the event loop
            for hook in self.hooks:
                await anyio.to_thread.run_sync(hook.run_checks)
            if self.cascade_to is not None and any(h.failed for h in self.hooks):
                self.escalation, self.status = self.cascade_to, "escalated"
        self.completion_tokens = sum(o.completion_tokens for o in stream.last.values())
        await self._account(stream.last, reasons, time.perf_counter() - started)

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
        caps = {r.request_id: r.params.max_tokens for r in self.requests}
        tokens = Tokens(
            prompt=self.prompt_tokens,
            completion=self.completion_tokens,
            cached_prompt=cached,
            draft_accepted=sum(o.draft_accepted for o in outs if o),
            policy_cut=cut,
            verifier_cut=sum(h.tokens_saved(caps) for h in self.hooks),
            cache_hit=self.cache.answer is not None,
        )
        price = charge(self.policy.policy, self.tier, tokens)
        if self.status == "escalated":  # the retry's row holds the always-large counterfactual: this one only costs
            price = Charge(cost=price.cost, counterfactual=Decimal(0))
        self.finish_reasons = list(reasons)
        self.choice_tokens = [o.completion_tokens if o else 0 for o in outs]
        rec = UsageRecord(
            request_id=self.request_id,
            tenant_id=self.principal.tenant_id,
            api_key_id=self.principal.key_id,
            endpoint=self.endpoint,
            model=self.tier_model,
            tier=self.tier,
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
            verifier_actions=self.verifier_actions,
            cache_status=self.cache.status,
            route="direct" if self.route is None else "auto",
            **price.ledger_fields(),
        )
        self.charged = True
        if self.metrics is not None:
            self.metrics.record_request(rec, self.ttft, seconds)
        if self.policy.policy.logging.log_prompts:  # the tenant opted in to its text in our logs
            log_exchange(self, self.candidates[0].engine.tokenizer)
        await self.ledger.write(rec)  # group-committed with concurrent requests' rows
        await self.budgets.settle(self.reservation, price.cost, tokens.prompt + tokens.completion)

    @property
    def _choices_per_prompt(self) -> int:
        return max(1, len(self.requests) // max(1, self.num_prompts))

    async def after_response(self) -> None:
        """Called once the response has gone out: the routing stage's follow-ups (stored prompt, shadow run)."""
        if self.routing is not None and self.route is not None and not self._followed_up:
            self._followed_up = True
            self.routing.after_response(self)

    async def abandon(self) -> None:
        """Give back the reservation of a generation that never ran (its client left first); one that a tier
        took (`begin`) but nobody read is aborted and billed for what ran."""
        if self.status == "pending" and not self.charged:
            if self._stream is not None:
                self.status = "aborted"
                with anyio.CancelScope(shield=True):
                    await self._settle_stream([None] * len(self.requests), self._started or time.perf_counter())
                return
            self.status = "abandoned"
            await self._release()

    async def _release(self) -> None:
        """Settle the reservation to nothing: the request never ran."""
        self.charged = True
        with anyio.CancelScope(shield=True):
            await self.budgets.settle(self.reservation, Decimal(0), 0)


class _Primed:
    """A stream whose first output `begin` already read (to know the tier answers); it is delivered first."""

    def __init__(self, stream: OutputStream, first: RequestOutput) -> None:
        self._stream = stream
        self._first: RequestOutput | None = first

    @property
    def last(self) -> dict[str, RequestOutput]:
        return self._stream.last

    def __aiter__(self) -> _Primed:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._stream)

    async def aclose(self) -> None:
        await self._stream.aclose()


def _failed_before_output(out: RequestOutput) -> bool:
    return out.finish_reason is FinishReason.ERROR and out.completion_tokens == 0


class Pipeline:
    def __init__(
        self,
        engines: Mapping[str, TierEngine],
        ledger: Ledger,
        settings: Settings,
        policies: PolicyStore,
        budgets: Budgets,
        cache: CacheStage | None = None,
        metrics: Metrics | None = None,
        routing: RoutingStage | None = None,
        probe: AnswerProbe | None = None,
    ) -> None:
        self.engines = dict(engines)
        self.ledger = ledger
        self.settings = settings
        self.policies = policies
        self.budgets = budgets
        self.cache = cache
        self.metrics = metrics
        self.routing = routing or RoutingStage(None, self.engines)
        self.probe = probe  # the trained answer probe, for policies with the `probe` check

    async def policy(self, principal: Principal) -> Versioned:
        if (hit := self.policies.cached(principal.tenant_id)) is not None:
            return hit  # the common case: no thread hop
        return await anyio.to_thread.run_sync(self.policies.current, principal.tenant_id)

    def engine(self, model: str, policy: Policy) -> TierEngine:
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
        return engine

    def candidates(self, model: str, policy: Policy, requests: list[EngineRequest]) -> list[Candidate]:
        """The live tiers that may serve, in order: `model`, then its fallback chain (tiers the policy allows
        and whose context takes these requests)."""
        out: list[Candidate] = []
        name: str | None = model
        seen: set[str] = set()
        while name is not None and name not in seen:
            seen.add(name)
            engine, tier = self.engines.get(name), self.settings.tiers.get(name)
            if engine is not None and engine.alive and (name == model or _fits(engine, requests, policy, name)):
                out.append(Candidate(name, engine, _checkpoint(self.settings, name)))
            name = tier.fallback if tier else None
        return out

    async def start_chat(
        self,
        principal: Principal,
        body: ChatCompletionRequest,
        cache_header: str | None = None,
        escalated_from: str | None = None,
    ) -> Generation:
        policy = await self.policy(principal)
        routed = escalated_from is None and self.routing.wants(body.model, policy.policy)
        if not routed:
            self.engine(body.model, policy.policy)  # an unknown or forbidden tier is refused before anything else
        _reject_unsupported(body, UNSUPPORTED_CHAT)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        route = await self.routing.route(principal, policy.policy, [messages]) if routed else None
        engine = self.engine(route.tier if route else body.model, policy.policy)
        # The model (and the cache key) see the policy's instruction; routing and stored prompts see the client's.
        shown = instructed(messages, policy.policy.sampling.system_instruction)
        try:
            prompt = await _tokenize(sum(len(m["content"]) for m in shown), engine.tokenizer.encode_chat, shown)
        except ChatTemplateError as exc:
            raise invalid(str(exc), param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        grammar = await _grammar(engine, body.response_format)
        return await self._generation(
            "chat.completions", "chatcmpl", principal, policy, body, engine, [prompt], max_tokens,
            shown, cache_header, route, [messages], grammar, escalated_from,
        )  # fmt: skip

    async def start_completion(
        self,
        principal: Principal,
        body: CompletionRequest,
        cache_header: str | None = None,
        escalated_from: str | None = None,
    ) -> Generation:
        policy = await self.policy(principal)
        routed = escalated_from is None and self.routing.wants(body.model, policy.policy)
        if not routed:
            self.engine(body.model, policy.policy)
        _reject_unsupported(body, UNSUPPORTED_COMPLETION)
        conversations = _prompt_conversations(body.prompt) if routed else []
        route = await self.routing.route(principal, policy.policy, conversations) if routed else None
        engine = self.engine(route.tier if route else body.model, policy.policy)
        size = len(body.prompt) if isinstance(body.prompt, str) else INLINE_TOKENIZE_CHARS  # lists: off the loop
        prompts = await _tokenize(size, _completion_prompts, body.prompt, engine.tokenizer)
        return await self._generation(
            "completions", "cmpl", principal, policy, body, engine, prompts, body.max_tokens, body.prompt,
            cache_header, route, conversations, None, escalated_from,
        )  # fmt: skip

    async def _generation(
        self,
        endpoint: str,
        id_prefix: str,
        principal: Principal,
        policy: Versioned,
        body: ChatCompletionRequest | CompletionRequest,
        engine: TierEngine,
        prompts: list[list[int]],
        max_tokens: int | None,
        conversation: Any,
        cache_header: str | None,
        route: RouteDecision | None,
        conversations: list[Any],
        grammar: Grammar | None = None,
        escalated_from: str | None = None,
    ) -> Generation:
        tier = route.tier if route is not None else body.model  # the answer's tier: the cache keys on it
        if route is not None and self.metrics is not None:
            self.metrics.record_route(route.seconds)
        if body.n * len(prompts) > self.settings.max_n:
            raise invalid(f"at most {self.settings.max_n} choices per request (n × prompts)", param="n")
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        # Cached prompt prefixes are shared within a tenant only, unless configured otherwise: a
        # faster first token would tell one tenant what another tenant's prompts begin with.
        salt = f"tenant:{principal.tenant_id}" if self.settings.prefix_cache_scope == "tenant" else ""
        requests, asked, hooks = [], [], []
        settings = policy.policy.verifiers
        verifier, checks = (
            build_verifiers(settings, body.n, self.probe) if settings.enabled or settings.checks else (None, None)
        )
        for p, prompt in enumerate(prompts):
            params, wanted = self._params(body, engine, prompt, max_tokens, policy.policy)
            ids = [f"{request_id}-{p * body.n + j}" for j in range(body.n)]
            hook = None
            if verifier is not None or checks is not None:  # one per prompt: its choices are judged together
                hook = VerifierHook(verifier, _verifier_context(body, p), ids, checks)
                hooks.append(hook)
            for j, rid in enumerate(ids):
                seeded = params if params.seed is None else replace(params, seed=params.seed + j)
                requests.append(EngineRequest(rid, prompt, seeded, cache_salt=salt, grammar=grammar, hook=hook))
                asked.append(wanted)
        prompt_tokens = sum(len(p) for p in prompts)
        completion_max = sum(r.params.max_tokens for r in requests)
        candidates = self.candidates(tier, policy.policy, requests)
        if grammar is not None:  # compiled for this engine's vocabulary: no other tier can take it
            candidates = [c for c in candidates if c.engine is engine]
        if not candidates:
            raise _unavailable(body.model)
        cache = BYPASS
        if self.cache is not None:
            mode = cache_mode(body.model_extra, cache_header)
            cache = await self.cache.lookup(
                principal.tenant_id, policy.policy.cache, mode, endpoint, tier, conversation,
                _answer_params(body, requests[0].params),
            )  # fmt: skip
        # The worst case on whichever candidate may end up serving: a fallback is billed at its own prices.
        worst_money = max(worst_case(policy.policy, c.name, prompt_tokens, completion_max) for c in candidates)
        if cache.answer is not None:  # a hit costs nothing; rate limits still count it
            worst_money, prompt_tokens_worst, completion_max = Decimal(0), 0, 0
        else:
            prompt_tokens_worst = prompt_tokens
        try:
            reservation = await self.budgets.admit(
                request_id,
                policy.policy,
                principal.tenant_id,
                principal.key_id,
                worst_money,
                prompt_tokens_worst + completion_max,
            )
        except BudgetError as exc:
            raise from_budget(exc) from exc
        serving = Candidate(tier, engine, _checkpoint(self.settings, tier))
        if cache.answer is None:  # a cached answer is the requested tier's, even while it is down
            serving = candidates[0]
        return Generation(
            request_id=request_id,
            endpoint=endpoint,
            model=body.model,
            principal=principal,
            candidates=candidates,
            requests=requests,
            prompt_tokens=prompt_tokens,
            ledger=self.ledger,
            budgets=self.budgets,
            policy=policy,
            reservation=reservation,
            tier=serving.name,
            tier_model=serving.checkpoint,
            requested_max=asked,
            requested_max_tokens=max_tokens,
            num_prompts=len(prompts),
            cache=cache,
            cache_stage=self.cache,
            metrics=self.metrics,
            route=route,
            routing=self.routing,
            conversations=conversations,
            hooks=hooks,
            cascade_to=self._cascade_target(body, policy.policy, tier, hooks, escalated_from),
            escalated_from=escalated_from,
        )

    def _cascade_target(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        policy: Policy,
        tier: str,
        hooks: list[VerifierHook],
        escalated_from: str | None,
    ) -> str | None:
        """The tier a failed answer goes to: the policy's cascade target, when it is another tier that the
        policy allows and that is up. Not for streams (what was streamed cannot be taken back) and not
        twice."""
        target = policy.verifiers.cascade_to
        if not policy.verifiers.cascade or not hooks or body.stream or escalated_from is not None or tier == target:
            return None
        engine = self.engines.get(target)
        return target if engine is not None and engine.alive and policy.allows(target) else None

    async def escalate(self, gen: Generation, body: ChatCompletionRequest | CompletionRequest) -> Generation:
        """A new generation of `body` on the tier `gen`'s failed answer escalates to (its own reservation and
        ledger row; not routed and not escalated again; the client's cache settings apply)."""
        assert gen.escalation is not None
        retry = body.model_copy(update={"model": gen.escalation})
        if isinstance(retry, ChatCompletionRequest):
            return await self.start_chat(gen.principal, retry, escalated_from=gen.request_id)
        return await self.start_completion(gen.principal, retry, escalated_from=gen.request_id)

    def _params(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        engine: TierEngine,
        prompt: list[int],
        max_tokens: int | None,
        policy: Policy,
    ) -> tuple[SamplingParams, int]:
        """The engine's sampling parameters after the policy's clamps, and the max tokens asked for."""
        room = engine.max_model_len - len(prompt)
        if max_tokens is None:
            max_tokens = min(room, self.settings.default_max_tokens or room)
            max_tokens = max(max_tokens, 1)  # no room left: the context check below explains
        given = body.model_fields_set  # a penalty the client left out takes the policy's default
        s = resolve(
            policy.sampling,
            Asked(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                frequency_penalty=body.frequency_penalty if "frequency_penalty" in given else None,
                presence_penalty=body.presence_penalty if "presence_penalty" in given else None,
                stop=tuple(body.stop_list),
            ),
        )
        try:
            params = SamplingParams(
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=body.top_k or 0,
                seed=body.seed,
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                stop=s.stop,
            )
            engine.check(prompt, params.max_tokens)
        except RequestRejected as exc:
            param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            raise invalid(str(exc), param=param, code=exc.code) from None
        except ValueError as exc:
            raise invalid(str(exc)) from None
        return params, min(max_tokens, max(room, 1))


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
        **({"response_format": fmt} if (fmt := _response_format(body)) is not None else {}),
    }


def _response_format(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
    """The request's `response_format` as JSON, None for free text (the cache key and the verifiers read it)."""
    fmt = getattr(body, "response_format", None)
    if fmt is None or fmt.type == "text":
        return None
    return fmt.model_dump(by_alias=True, exclude_none=True)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def _checkpoint(settings: Settings, name: str) -> str:
    tier = settings.tiers.get(name)
    return tier.model if tier else name


def _fits(engine: TierEngine, requests: list[EngineRequest], policy: Policy, name: str) -> bool:
    """May fallback tier `name` serve these requests: allowed by the policy, and within its context?"""
    if not policy.allows(name):
        return False
    try:
        for r in requests:
            engine.check(r.prompt_token_ids, r.params.max_tokens)
    except RequestRejected:
        return False
    return True


def _prompt_param(endpoint: str) -> str:
    return "messages" if endpoint == "chat.completions" else "prompt"


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


def _verifier_context(body: ChatCompletionRequest | CompletionRequest, index: int) -> Context:
    tests = (body.model_extra or {}).get("tests")  # extension: code that checks a code answer (`code` check)
    return Context(
        prompt=_prompt_text(body, index),
        response_format=_response_format(body),
        tests=tests if isinstance(tests, str) else None,
    )


def _prompt_text(body: ChatCompletionRequest | CompletionRequest, index: int) -> str:
    """What verifiers read as the question: the last user turn, or prompt `index` when it is text."""
    if isinstance(body, ChatCompletionRequest):
        return next((m.text() for m in reversed(body.messages) if m.role == "user"), "")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    text = prompts[index] if index < len(prompts) else ""
    return text if isinstance(text, str) else ""


async def _grammar(engine: TierEngine, fmt: ResponseFormat | None) -> Grammar | None:
    """The token grammar a `response_format` asks for (compiled off the event loop), or None for text."""
    if fmt is None or fmt.type == "text":
        return None
    compiler = await anyio.to_thread.run_sync(lambda: engine.grammars)  # built on first use: ~0.1-1 s
    if compiler is None:
        raise invalid(
            f"Tier `{engine.name}` cannot constrain its output; `response_format` needs an in-process tier.",
            param="response_format",
            code="unsupported_parameter",
        )
    try:
        if fmt.type == "json_object":
            return await anyio.to_thread.run_sync(compiler.any_json)
        if fmt.type == "json_schema":
            assert fmt.json_schema is not None
            schema = fmt.json_schema.schema_
            if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
                raise GrammarError(f"the schema is longer than {MAX_SCHEMA_CHARS} characters as JSON")
            return await anyio.to_thread.run_sync(compiler.json_schema, schema)
        assert fmt.regex is not None
        return await anyio.to_thread.run_sync(compiler.regex, fmt.regex)
    except GrammarError as exc:
        raise invalid(str(exc), param="response_format") from None


def _prompt_conversations(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """Text prompts as the one-turn conversations the router reads; token ids it cannot read."""
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not all(isinstance(t, str) for t in texts):
        raise invalid("`model: auto` routes text prompts; name a tier to send token ids.", param="prompt")
    return [[{"role": "user", "content": t}] for t in texts]


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
