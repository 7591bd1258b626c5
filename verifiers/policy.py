"""A tenant policy's verifiers, built for one request."""

from __future__ import annotations

from policies.policy import VerifierSettings
from verifiers.base import Verifier
from verifiers.compose import all_of, any_of
from verifiers.confidence import Confidence
from verifiers.degeneration import Degeneration


def build_verifier(settings: VerifierSettings, choices: int) -> Verifier | None:
    """The policy's in-flight verifiers for a request with `choices` choices, combined as it says; None if
    none applies (confidence judges a vote, so it needs two choices or more)."""
    every = settings.every_n_tokens
    members: list[Verifier] = []
    for name in dict.fromkeys(settings.enabled):
        if name == "degeneration":
            d = settings.degeneration
            members.append(
                Degeneration(every=every, min_repeats=d.min_repeats, min_tokens=d.min_tokens, max_items=d.max_items)
            )
        elif name == "confidence" and choices > 1:
            c = settings.confidence
            options = c.model_dump()  # window, threshold, prune_quantile, min_keep, consensus, min_votes
            members.append(Confidence(every=every, **options))
    if not members:
        return None
    if len(members) == 1:
        return members[0]
    return any_of(*members) if settings.combine == "any" else all_of(*members)
