"""The cascade: an answer that fails the policy's final checks is retried, once, on the policy's cascade
tier, and the retry's answer goes out.

    target     decided at admission: the policy's `cascade_to`, when the policy cascades, the request has
               verifiers, is not streamed (what was streamed cannot be taken back), is not a retry
               itself, and the target is another tier that the policy allows and that is up
    escalates  after the run: the final checks ran and one of them failed
    complete   a non-streamed request run to its end, and its retry if it escalated. The retry is a
               request of its own (its own reservation and ledger row; not routed and not escalated
               again); the first attempt's row holds only its cost (a negative verifier saving). If the
               larger tier refuses (budget, rate limit, down) or fails, the first answer stands.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engines.protocol import TierEngine
from gateway.errors import APIError
from gateway.pipeline.plan import Checks
from policies.policy import Policy
from verifiers.hook import VerifierHook

if TYPE_CHECKING:
    from gateway.pipeline.run import Generation, Watch


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


@dataclass(frozen=True)
class Answer:
    """A non-streamed request's answer: whose it is, its choices, and the first attempt if it was retried."""

    generation: Generation  # whose answer goes out: the retry's, or the first attempt's
    texts: list[str]
    reasons: list[str | None]
    first: Generation  # the first attempt (`generation` itself when there was no retry)
    refused: str | None = None  # the retry's error code (or status) when it failed: the first answer stands

    @property
    def escalated(self) -> bool:
        return self.generation is not self.first


async def complete(gen: Generation, retry: Callable[[], Awaitable[Generation]], watch: Watch) -> Answer:
    """Run `gen` to its end (`watch` aborts it if the client leaves), then `retry()` if its answer failed."""
    try:
        # A cached answer is ready at once: no generation to abort, so no disconnect watcher to start.
        work = gen.collect()
        texts, reasons = await (work if gen.plan.cache.answer is not None else watch(work))
    finally:
        await gen.abandon()  # a no-op once it ran
    if gen.escalation is None:
        return Answer(gen, texts, reasons, gen)
    try:
        second = await retry()
        try:
            retried = await watch(second.collect())
        finally:
            await second.abandon()
    except APIError as exc:  # the larger tier refused (budget, rate limit, down): the first answer stands
        return Answer(gen, texts, reasons, gen, refused=str(exc.code or exc.status))
    return Answer(second, *retried, gen)
