"""What a request costs and what it saved, in `Decimal` from tokens to dollars.

Every request is compared with the counterfactual of serving it on the large tier with no cache,
no speculation and no policy cap. The difference splits exactly into levers:

    counterfactual − cost = routing + cache + speculation + policy + verifier

Routing's saving is what the tier that served costs less than the large tier for the same tokens,
whoever chose the tier (the router for `model: "auto"`, else the client). A shadow run (the router's
online relabeling, `charge_shadow`) is routing's own overhead: an always-large gateway would never
have run it, so its counterfactual is 0 and its price on the large tier is a negative routing saving.
Likewise the tokens a final check asks the serving tier for (`check_prompt`, `check_completion`: a
program of thought, a second sample) are billed at that tier's prices but are no part of the
counterfactual: their cost is a negative verifier saving.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from core.money import ZERO
from policies.policy import PER_MILLION, Policy


@dataclass(frozen=True)
class Tokens:
    prompt: int
    completion: int
    cached_prompt: int = 0  # prompt tokens found in the KV prefix cache
    draft_accepted: int = 0  # completion tokens drafted by a smaller tier and verified by this one
    policy_cut: int = 0  # completion tokens a policy cap stopped (estimated from requests cut at the cap)
    verifier_cut: int = 0  # completion tokens a verifier's early stop saved
    cache_hit: bool = False  # answered from the response cache: nothing ran
    check_prompt: int = 0  # prompt tokens of the questions final checks asked the serving tier
    check_completion: int = 0  # and their answers' tokens


@dataclass(frozen=True)
class Charge:
    cost: Decimal
    counterfactual: Decimal
    saved_routing: Decimal = ZERO
    saved_cache: Decimal = ZERO
    saved_speculation: Decimal = ZERO
    saved_policy: Decimal = ZERO
    saved_verifier: Decimal = ZERO

    @property
    def saved(self) -> Decimal:
        return self.counterfactual - self.cost

    def ledger_fields(self) -> dict[str, Decimal]:
        """The usage row's money columns (`gateway.accounting.ledger.UsageRecord`)."""
        return {
            "cost": self.cost,
            "counterfactual_cost": self.counterfactual,
            "saved_cache": self.saved_cache,
            "saved_routing": self.saved_routing,
            "saved_speculation": self.saved_speculation,
            "saved_verifier": self.saved_verifier,
            "saved_policy": self.saved_policy,
        }


def charge(policy: Policy, tier: str, t: Tokens) -> Charge:
    p, large = policy.price(tier), policy.price(policy.counterfactual_tier)
    full_completion = t.completion + t.policy_cut + t.verifier_cut
    counterfactual = (t.prompt * large.prompt + full_completion * large.completion) / PER_MILLION
    if t.cache_hit:
        return Charge(cost=ZERO, counterfactual=counterfactual, saved_cache=counterfactual)
    cost = (
        (t.prompt - t.cached_prompt) * p.prompt
        + t.cached_prompt * p.cached
        + (t.completion - t.draft_accepted) * p.completion
        + t.draft_accepted * p.drafted
    ) / PER_MILLION
    at_large = (t.prompt * large.prompt + t.completion * large.completion) / PER_MILLION
    at_tier = (t.prompt * p.prompt + t.completion * p.completion) / PER_MILLION
    checks = (t.check_prompt * p.prompt + t.check_completion * p.completion) / PER_MILLION
    return Charge(
        cost=cost + checks,
        counterfactual=counterfactual,
        saved_routing=at_large - at_tier,
        saved_cache=t.cached_prompt * (p.prompt - p.cached) / PER_MILLION,
        saved_speculation=t.draft_accepted * (p.completion - p.drafted) / PER_MILLION,
        saved_policy=t.policy_cut * large.completion / PER_MILLION,
        saved_verifier=t.verifier_cut * large.completion / PER_MILLION - checks,
    )


def charge_shadow(policy: Policy, tier: str, t: Tokens) -> Charge:
    """A shadow run's charge: its cost as on `tier`, against a counterfactual of nothing."""
    c = charge(policy, tier, t)
    p = policy.price(tier)
    at_tier = (t.prompt * p.prompt + t.completion * p.completion) / PER_MILLION
    return Charge(
        cost=c.cost,
        counterfactual=ZERO,
        saved_routing=-at_tier,  # what routing's relabeling cost, before the KV cache and drafting saved some of it
        saved_cache=c.saved_cache,
        saved_speculation=c.saved_speculation,
    )


def worst_case(policy: Policy, tier: str, prompt_tokens: int, completion_tokens: int) -> Decimal:
    """The most a request can cost: every prompt token uncached, every completion token generated."""
    p = policy.price(tier)
    return (prompt_tokens * p.prompt + completion_tokens * p.completion) / PER_MILLION
