"""The cascade: an answer that fails the policy's final checks is retried, once, on the policy's cascade
tier, and the retry's answer goes out.

    target     decided at admission: the policy's `cascade_to`, when the policy cascades, the request has
               verifiers, is not streamed (what was streamed cannot be taken back), is not a retry
               itself, and the target is another tier that the policy allows and that is up
    escalates  after the run: the final checks ran and one of them failed

`Pipeline.complete` (`gateway.pipeline.service`) runs a non-streamed request to its end, and its retry if it
escalated. The retry is a request of its own (its own reservation and ledger row; not routed and not
escalated again); the first attempt's row holds only its cost (a negative verifier saving). If the larger
tier refuses (budget, rate limit, down) or fails, the first answer stands.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engines.protocol import TierEngine
from gateway.pipeline.plan import Checks
from policies.policy import Policy
from verifiers.hook import VerifierHook

__all__ = ["escalates", "target"]


def target(
    policy: Policy,
    tier: str,
    hooks: Sequence[VerifierHook],
    engines: Mapping[str, TierEngine],
    *,
    stream: bool,
    escalated_from: str | None,
) -> str | None:
    """The tier a failed answer of a request on `tier` goes to, or None: see the module's docstring."""
    to = policy.verifiers.cascade_to
    if not policy.verifiers.cascade or not hooks or stream or escalated_from is not None or tier == to:
        return None
    engine = engines.get(to)
    return to if engine is not None and engine.alive and policy.allows(to) else None


def escalates(checks: Checks) -> bool:
    """Whether a finished answer, its final checks run, is retried on the cascade's tier."""
    return checks.cascade_to is not None and any(h.failed for h in checks.hooks)
