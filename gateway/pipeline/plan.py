"""What admission decides (`Plan`, frozen) and what a run ends with (`Outcome`, frozen).

A plan is made once, before anything runs, and never changes; the run's own changing state stays in
`gateway.pipeline.run`. Metering, the cache store, the routing stage's follow-ups and the cascade read
only these two.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engines.request import EngineRequest, RequestOutput
from gateway.accounting.tenants import Principal
from gateway.cache.exact import CachedAnswer
from gateway.cache.stage import CacheDecision
from gateway.pipeline.choices import Candidate
from gateway.routing.stage import RouteDecision
from gateway.tool_calls import CallSpec
from policies.budgets import Reservation
from policies.store import Versioned
from verifiers.hook import VerifierHook

if TYPE_CHECKING:  # single_flight reads plans: the type only, no import cycle
    from gateway.pipeline.single_flight import Flight


@dataclass(frozen=True)
class Caller:
    """Who asked, for what, under which policy."""

    request_id: str
    endpoint: str  # chat.completions | completions
    model: str  # the model asked for (a tier, or `auto`); responses name it whichever tier serves
    principal: Principal
    policy: Versioned
    created: int  # unix seconds, as responses show it
    tier: str = ""  # the tier it named, once aliases and `tier:ADAPTER` are resolved (`auto` when routed)


@dataclass(frozen=True)
class Work:
    """The engine requests, and who may run them."""

    requests: tuple[EngineRequest, ...]  # one per choice, in choice order
    num_prompts: int
    prompt_tokens: int  # each distinct prompt counted once, as OpenAI bills n > 1
    requested_max: tuple[int, ...]  # per choice: what the request asked for (or its room), before the policy cap
    requested_max_tokens: int | None  # as sent
    candidates: tuple[Candidate, ...]  # who may serve, in order: the requested tier, then its fallbacks

    @property
    def num_choices(self) -> int:
        return len(self.requests)

    @property
    def choices_per_prompt(self) -> int:
        return max(1, len(self.requests) // max(1, self.num_prompts))


@dataclass(frozen=True)
class Checks:
    """The policy's verifiers, and where an answer that fails them is retried."""

    hooks: tuple[VerifierHook, ...] = ()  # one per prompt: its choices are judged together
    cascade_to: str | None = None  # the tier a failed answer is retried on (the policy's cascade)
    escalated_from: str | None = None  # this request retries that request's failed answer


@dataclass(frozen=True)
class Plan:
    """A request that passed every check, with its worst case reserved: what a run needs and nothing else."""

    caller: Caller
    work: Work
    checks: Checks
    cache: CacheDecision
    reservation: Reservation
    serving: Candidate  # who serves unless it is down: the first candidate, or the tier of a cached answer
    route: RouteDecision | None = None  # set when the router chose the tier
    conversations: tuple[Any, ...] = ()  # what the router decided on
    lead: Flight | None = None  # single flight: identical requests in the air wait for this one's answer
    follow: Flight | None = None  # a streamed follower: the leader whose deltas it streams (`single_flight`)
    calls: CallSpec | None = None  # answers are read for tool calls (`gateway.tool_calls`)

    @property
    def request_id(self) -> str:
        return self.caller.request_id

    @property
    def wanted_tier(self) -> str:
        """The tier asked for, or the one the router chose: whose answers the cache keys hold."""
        return self.route.tier if self.route is not None else (self.caller.tier or self.caller.model)

    @property
    def verifier_actions(self) -> list[dict[str, Any]]:
        """What the verifiers did, choices numbered as in the response."""
        per_prompt = self.work.choices_per_prompt
        return [
            {**a, "choice": p * per_prompt + a["choice"]} for p, h in enumerate(self.checks.hooks) for a in h.summary()
        ]

    def served_by(self, answer: CachedAnswer) -> Plan:
        """A streamed follower's plan once its leader's answer served it: a cache hit, as metering bills one."""
        return replace(self, cache=replace(self.cache, key=None, answer=answer), follow=None)

    def on_own(self) -> Plan:
        """A streamed follower's plan once its leader was released: the plain miss it would have been."""
        return replace(self, cache=CacheDecision("miss", key=self.cache.key, settings=self.cache.settings), follow=None)


@dataclass(frozen=True)
class Outcome:
    """What ran: how it ended, on which tier, what it produced and how long it took."""

    status: str  # ok | aborted | error | escalated
    served: Candidate  # the tier that served (a fallback when the requested one was down)
    texts: tuple[str, ...]  # each choice's text (a cached answer's texts on a hit)
    finish_reasons: tuple[str | None, ...]
    outputs: tuple[RequestOutput | None, ...]  # each request's last output; None: none (or a cached answer)
    completion_tokens: int
    seconds: float
    ttft: float | None  # seconds to the first generated text (engine runs only)
    check_tokens: tuple[int, int] = (0, 0)  # (prompt, completion) final checks asked the serving tier for

    @property
    def choice_tokens(self) -> list[int]:
        return [o.completion_tokens if o else 0 for o in self.outputs]
