"""Admission: a validated request → a frozen `Plan`, or a refusal (4xx, 429, 503) before anything runs.

principal → the tenant's policy (allowed tiers, sampling clamps)
          → the tier: the one named, or the router's choice (`auto`, `gateway.routing.stage`)
          → the prompts as token ids for that tier, within every limit
          → the policy's verifiers, one hook per prompt, and the cascade's target
          → the tier ladder: the tier, then its live fallbacks that the policy allows
          → the response cache's lookup, and single flight: follow an identical request in the air (wait
            for its answer), or lead the requests that will follow this one (`single_flight`)
          → the budget and rate-limit reservation of the worst case on any tier of the ladder
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from decimal import Decimal
from typing import TypeVar

import anyio

from core.settings import Settings
from engines.protocol import RequestRejected, TierEngine
from engines.remote.engine import RemoteEngine
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from gateway.accounting.metrics import Metrics
from gateway.accounting.tenants import Principal
from gateway.adapters import AdapterRecord, AdapterStore
from gateway.cache.stage import BYPASS, CacheDecision, CacheStage, cache_mode
from gateway.http.errors import from_budget, invalid
from gateway.http.schemas import UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION, ChatCompletionRequest, CompletionRequest
from gateway.pipeline import cascade
from gateway.pipeline.adapter_choice import AdapterChoice, cache_tier, ledger_model
from gateway.pipeline.aliases import resolve
from gateway.pipeline.choices import Candidate
from gateway.pipeline.plan import Caller, Checks, Plan, Work
from gateway.pipeline.prompts import (
    INLINE_TOKENIZE_CHARS,
    Body,
    Prepared,
    answer_params,
    chat_messages,
    chat_prompt,
    completion_prompts,
    grammar,
    prompt_conversations,
    sampling_params,
    tokenize,
    tool_grammar,
    verifier_context,
)
from gateway.pipeline.refusals import model_not_allowed, model_not_found, reject_unsupported, unavailable
from gateway.pipeline.single_flight import Flights, Seat, join
from gateway.pipeline.wires import CHAT, Wire
from gateway.routing.stage import Lock, RoutingStage
from gateway.routing.tier_lock import continues, opening_key
from gateway.tool_calls import routing_turns, tool_request
from policies.budgets import BudgetError, Budgets, Reservation
from policies.policy import Policy
from policies.pricing import worst_case
from policies.store import PolicyStore, Versioned
from verifiers.hook import VerifierHook
from verifiers.policy import build_verifiers
from verifiers.probe import AnswerProbe

B = TypeVar("B", ChatCompletionRequest, CompletionRequest)


class Admission:
    """The admission steps, over the stores and stages they read. Nothing here runs a model: a refusal
    leaves nothing reserved, and a plan holds its reservation until the run settles it."""

    def __init__(
        self,
        engines: Mapping[str, TierEngine],
        settings: Settings,
        policies: PolicyStore,
        budgets: Budgets,
        cache: CacheStage | None = None,
        metrics: Metrics | None = None,
        routing: RoutingStage | None = None,
        probe: AnswerProbe | None = None,
        adapters: AdapterStore | None = None,
    ) -> None:
        self.engines = dict(engines)
        self.settings = settings
        self.policies = policies
        self.budgets = budgets
        self.cache = cache
        self.metrics = metrics
        self.routing = routing or RoutingStage(None, self.engines)
        self.probe = probe  # the trained answer probe, for policies with the `probe` check
        self.flights = Flights()  # this process's requests whose answers others may wait for
        self.adapters = AdapterChoice(adapters, self.engines)  # `model: "small:NAME"`, a policy's default adapter
        if self.routing.explorer is not None:  # explore runs judge a tenant's tier under its adapter
            self.routing.explorer.adapter_key = self.adapters.key_for

    async def policy(self, principal: Principal) -> Versioned:
        if (hit := self.policies.cached(principal.tenant_id)) is not None:
            return hit  # the common case: no thread hop
        return await anyio.to_thread.run_sync(self.policies.current, principal.tenant_id)

    def engine(self, model: str, policy: Policy) -> TierEngine:
        engine = self.engines.get(model)
        if engine is None:
            raise model_not_found(model)
        if not policy.allows(model):
            raise model_not_allowed(model, [t for t in self.engines if policy.allows(t)])
        return engine

    def candidates(
        self, model: str, policy: Policy, requests: list[EngineRequest], adapter: AdapterRecord | None = None
    ) -> list[Candidate]:
        """The live tiers that may serve, in order: `model`, then its fallback chain (tiers the policy allows
        and whose context takes these requests)."""
        out: list[Candidate] = []
        name: str | None = model
        seen: set[str] = set()
        while name is not None and name not in seen:
            seen.add(name)
            engine, tier = self.engines.get(name), self.settings.tiers.get(name)
            if engine is not None and engine.alive and (name == model or _fits(engine, requests, policy, name)):
                out.append(Candidate(name, engine, self._checkpoint(name, adapter)))
            name = tier.fallback if tier else None
        return out

    def aliased(self, body: B, policy: Policy) -> B:
        """`body` naming what its model's alias names (`gateway.pipeline.aliases`), or `body` itself."""
        model = resolve(policy, self.settings.model_aliases, body.model)
        return body if model == body.model else body.model_copy(update={"model": model})

    def salt(self, principal: Principal) -> str:
        """The prefix-cache salt of a principal's requests: tenant scope keeps them to the tenant, since a
        faster first token would tell one tenant what another tenant's prompts begin with."""
        return f"tenant:{principal.tenant_id}" if self.settings.prefix_cache_scope == "tenant" else ""

    async def admit_chat(
        self,
        principal: Principal,
        body: ChatCompletionRequest,
        cache_header: str | None = None,
        escalated_from: str | None = None,
        wire: Wire = CHAT,
        continued: bool = False,
    ) -> Plan:
        """A chat request's plan: its messages through the tier's chat template (and the policy's instruction).
        `wire`: the API it came through, translated (`gateway.pipeline.wires`); `continued`: it continues a stored
        conversation (a previous response), so it stays on that conversation's tier like a tool loop's turn."""
        policy = await self.policy(principal)
        asked, body = body.model, self.aliased(body, policy.policy)
        body, named = await self.adapters.named(principal, body)
        routed = escalated_from is None and named is None and self.routing.wants(body.model, policy.policy)
        if not routed:
            self.engine(body.model, policy.policy)  # an unknown or forbidden tier is refused before anything else
        reject_unsupported(body, UNSUPPORTED_CHAT)
        tools = tool_request(body)
        if tools is not None and body.response_format is not None and body.response_format.type != "text":
            raise invalid("`response_format` cannot be combined with `tools`: a call's arguments already follow "
                          "its function's schema.", param="response_format")  # fmt: skip
        messages = [*routing_turns(tools), *chat_messages(body)]  # the router sees the tools offered, and how many
        route = None
        if routed:
            lock = tier_lock(principal, body, continued)
            route = await self.routing.route(principal, policy.policy, [messages], self.salt(principal), lock)
        tier = route.tier if route else body.model
        engine = self.engine(tier, policy.policy)
        adapter = named or await self.adapters.default(principal, policy.policy, tier)
        shown, prompt = await chat_prompt(engine, body, policy.policy, tools, wire)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if tools is None:
            constraint, calls = await grammar(engine, body.response_format), None
        else:
            constraint, calls = await tool_grammar(engine, tools)
        prepared = Prepared(
            endpoint=wire.endpoint,
            id_prefix=wire.id_prefix,
            asked=asked,
            engine=engine,
            prompts=[prompt],
            max_tokens=max_tokens,
            conversation=shown,
            conversations=[messages],
            route=route,
            grammar=constraint,
            calls=calls,
            adapter=adapter,
        )
        return await self._plan(principal, policy, body, prepared, cache_header, escalated_from)

    async def count_chat(self, principal: Principal, body: ChatCompletionRequest, wire: Wire = CHAT) -> int:
        """The prompt tokens `body` would be on the tier it names (`auto`: the first tier the policy allows, the
        cheapest), as admission tokenizes it: the tier's chat template, the tools, the policy's instruction."""
        policy = (await self.policy(principal)).policy
        model = resolve(policy, self.settings.model_aliases, body.model)
        model = (await self.adapters.named(principal, body.model_copy(update={"model": model})))[0].model
        if self.routing.wants(model, policy):
            model = next((t for t in self.engines if policy.allows(t)), model)
        engine = self.engine(model, policy)
        return len((await chat_prompt(engine, body, policy, tool_request(body), wire))[1])

    async def admit_completion(
        self,
        principal: Principal,
        body: CompletionRequest,
        cache_header: str | None = None,
        escalated_from: str | None = None,
    ) -> Plan:
        """A completion request's plan: one prompt or several (text or token ids), each run n times."""
        policy = await self.policy(principal)
        asked, body = body.model, self.aliased(body, policy.policy)
        body, named = await self.adapters.named(principal, body)
        routed = escalated_from is None and named is None and self.routing.wants(body.model, policy.policy)
        if not routed:
            self.engine(body.model, policy.policy)
        reject_unsupported(body, UNSUPPORTED_COMPLETION)
        conversations = prompt_conversations(body.prompt) if routed else []
        route = (
            await self.routing.route(principal, policy.policy, conversations, self.salt(principal)) if routed else None
        )
        tier = route.tier if route else body.model
        engine = self.engine(tier, policy.policy)
        adapter = named or await self.adapters.default(principal, policy.policy, tier)
        size = len(body.prompt) if isinstance(body.prompt, str) else INLINE_TOKENIZE_CHARS  # lists: off the loop
        prompts = await tokenize(size, completion_prompts, body.prompt, engine.tokenizer)
        prepared = Prepared(
            endpoint="completions",
            id_prefix="cmpl",
            asked=asked,
            engine=engine,
            prompts=prompts,
            max_tokens=body.max_tokens,
            conversation=body.prompt,
            conversations=conversations,
            route=route,
            adapter=adapter,
        )
        return await self._plan(principal, policy, body, prepared, cache_header, escalated_from)

    async def _plan(
        self,
        principal: Principal,
        policy: Versioned,
        body: Body,
        p: Prepared,
        cache_header: str | None,
        escalated_from: str | None,
    ) -> Plan:
        """The steps every endpoint shares, from the engine requests to the reservation (the module's docstring)."""
        tier = p.route.tier if p.route is not None else body.model  # the answer's tier: the cache keys on it
        if p.route is not None and self.metrics is not None:
            self.metrics.record_route(p.route.seconds)
        if body.n * len(p.prompts) > self.settings.max_n:
            raise invalid(f"at most {self.settings.max_n} choices per request (n × prompts)", param="n")
        request_id = f"{p.id_prefix}-{uuid.uuid4().hex}"
        adapter = self.adapters.served(p.engine, p.adapter) if p.adapter is not None else None
        requests, asked, hooks = self._engine_requests(request_id, principal, policy.policy, body, p, adapter)
        candidates = self.candidates(tier, policy.policy, requests, p.adapter)
        if p.grammar is not None or p.adapter is not None:  # compiled for this engine's vocabulary; its adapter
            candidates = [c for c in candidates if c.engine is p.engine]
        if requests[0].params.logprobs is not None:  # a remote's server does not hand back token ids
            if isinstance(p.engine, RemoteEngine):
                raise invalid(f"Tier `{p.engine.name}` is remote; `logprobs` needs an in-process tier.",
                              param="logprobs", code="unsupported_parameter")  # fmt: skip
            candidates = [c for c in candidates if not isinstance(c.engine, RemoteEngine)]
        if not candidates:
            raise unavailable(body.model)
        seat = await self._lookup(request_id, principal, policy.policy, body, p, tier, requests[0].params, cache_header)
        cache = seat.cache
        work = Work(
            requests=tuple(requests),
            num_prompts=len(p.prompts),
            prompt_tokens=sum(len(prompt) for prompt in p.prompts),
            requested_max=tuple(asked),
            requested_max_tokens=p.max_tokens,
            candidates=tuple(candidates),
        )
        try:
            if p.adapter is not None and cache.answer is None:  # only a request that runs needs it in memory
                await self.adapters.load(p.engine, p.adapter)
            reservation = await self._reserve(request_id, principal, policy.policy, work, cache)
        except BaseException:
            if seat.lead is not None:  # refused (or its adapter could not load): its followers run on their own
                seat.lead.release()
            raise
        # a cached answer is the requested tier's, even while it is down
        hit = Candidate(tier, p.engine, self._checkpoint(tier, p.adapter))
        serving = candidates[0] if cache.answer is None else hit
        target = cascade.target(
            policy.policy, tier, hooks, self.engines, stream=body.stream, escalated_from=escalated_from
        )
        return Plan(
            caller=Caller(
                request_id, p.endpoint, p.asked or body.model, principal, policy, int(time.time()), body.model
            ),
            work=work,
            checks=Checks(tuple(hooks), target, escalated_from),
            cache=cache,
            reservation=reservation,
            serving=serving,
            route=p.route,
            conversations=tuple(p.conversations),
            lead=seat.lead,
            follow=seat.follow,
            calls=p.calls,
        )

    def _engine_requests(
        self, request_id: str, principal: Principal, policy: Policy, body: Body, p: Prepared, adapter: str | None
    ) -> tuple[list[EngineRequest], list[int], list[VerifierHook]]:
        """One engine request per choice (n per prompt), the max tokens each asked for, and the verifier hooks."""
        salt = self.salt(principal)
        requests, asked, hooks = [], [], []
        settings = policy.verifiers
        verifier, checks = (
            build_verifiers(settings, body.n, self.probe) if settings.enabled or settings.checks else (None, None)
        )
        for i, prompt in enumerate(p.prompts):
            params, wanted = sampling_params(
                body, p.engine, prompt, p.max_tokens, policy, self.settings.default_max_tokens
            )
            ids = [f"{request_id}-{i * body.n + j}" for j in range(body.n)]
            hook = None
            if verifier is not None or checks is not None:  # one per prompt: its choices are judged together
                hook = VerifierHook(verifier, verifier_context(body, i), ids, checks)
                hooks.append(hook)
            for j, rid in enumerate(ids):
                seeded = params if params.seed is None else replace(params, seed=params.seed + j)
                requests.append(
                    EngineRequest(rid, prompt, seeded, cache_salt=salt, grammar=p.grammar, hook=hook, adapter=adapter)
                )
                asked.append(wanted)
        return requests, asked, hooks

    async def _lookup(
        self,
        request_id: str,
        principal: Principal,
        policy: Policy,
        body: Body,
        p: Prepared,
        tier: str,
        params: SamplingParams,
        cache_header: str | None,
    ) -> Seat:
        """The response cache's answer for `body` on `tier`, or the key to store its answer under; and its
        place in single flight (a follower has waited here for its leader's answer, or its start if streamed)."""
        if self.cache is None or params.logprobs is not None:  # a stored answer keeps no logprobs
            return Seat(BYPASS)
        mode = cache_mode(body.model_extra, cache_header)
        keyed = cache_tier(tier, p.adapter)  # the adapter's files are part of what answered
        decision = await self.cache.lookup(
            principal.tenant_id, policy.cache, mode, p.endpoint, keyed, p.conversation, answer_params(body, params)
        )
        tenant = principal.tenant_id
        return await join(self.flights, self.cache.semantic, tenant, request_id, decision, stream=body.stream)

    async def _reserve(
        self, request_id: str, principal: Principal, policy: Policy, work: Work, cache: CacheDecision
    ) -> Reservation:
        """Reserve the worst case against the tenant's budgets and rate limits, or refuse (`from_budget`)."""
        prompt_tokens, completion_max = work.prompt_tokens, sum(r.params.max_tokens for r in work.requests)
        # The worst case on whichever candidate may end up serving: a fallback is billed at its own prices.
        worst_money = max(worst_case(policy, c.name, prompt_tokens, completion_max) for c in work.candidates)
        if cache.answer is not None:  # a hit costs nothing; rate limits still count it
            worst_money, prompt_tokens, completion_max = Decimal(0), 0, 0
        try:
            return await self.budgets.admit(
                request_id, policy, principal.tenant_id, principal.key_id, worst_money, prompt_tokens + completion_max
            )
        except BudgetError as exc:
            raise from_budget(exc) from exc

    def _checkpoint(self, name: str, adapter: AdapterRecord | None = None) -> str:
        tier = self.settings.tiers.get(name)
        return ledger_model(tier.model if tier else name, adapter)


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


def tier_lock(principal: Principal, body: ChatCompletionRequest, continued: bool = False) -> Lock:
    """The conversation a routed chat request belongs to, and whether it continues a tool loop (or a stored
    response): such a turn goes to the tier its conversation's first turn went to (`gateway.routing.tier_lock`)."""
    turns = [{"role": m.role, "content": m.text(), "tool_calls": m.tool_calls} for m in body.messages]
    return Lock(opening_key(principal.tenant_id, turns), continued or continues(turns))
