"""What a verifier sees and what it says.

A verifier looks at a request (`Context`) and one or more of its generations (`Trace`: token ids, text,
per-token logprobs with the top alternatives) while they run or once they finish, and answers each
trace with a `Verdict`: continue, stop (good enough: end it here, keep what it has), prune (this path is
bad: end it and drop it) or escalate (the answer will not do: hand the request to a larger tier), with
a score and a reason; a check that could not run (no jail for its code) says unavailable, and the answer
is served without it. Verifiers that judge one trace at a time subclass `TraceVerifier`; those that
judge the traces of one request together (self-consistency votes) implement `check` over all of them.

`every` says how often an in-flight verifier wants to look: every N generated tokens of a trace
(0: only once it has finished). The engine calls in-flight verifiers from its step loop, so `check`
must be cheap (incremental where it can): slow checks (running tests, a learned probe) are final-only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from engines.request import TokenLogprob


class Action(StrEnum):
    CONTINUE = "continue"
    STOP = "stop"  # good enough: end the trace now and keep it
    PRUNE = "prune"  # a bad path: end the trace and drop it
    ESCALATE = "escalate"  # the answer will not do: retry the request on a larger tier
    # The check could not run here (no jail on this machine for its code): the answer is served without it,
    # and the record and `x-switchboard-verifiers` say so. Acts as continue.
    UNAVAILABLE = "unavailable"


# Which action wins when verifiers disagree (`any_of`): the most drastic. A check that could not run is
# above continue only so that the record keeps saying it did not run.
SEVERITY = {Action.CONTINUE: 0, Action.UNAVAILABLE: 1, Action.STOP: 2, Action.PRUNE: 3, Action.ESCALATE: 4}
PASSES = (Action.CONTINUE, Action.UNAVAILABLE)  # verdicts that ask for nothing to be done


@dataclass(frozen=True)
class Verdict:
    action: Action
    score: float = 1.0  # the verifier's own scale; higher is better
    reason: str = ""
    verifier: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "verifier": self.verifier,
            "action": str(self.action),
            "score": round(self.score, 4),
            "reason": self.reason,
        }


# What a verifier answers for a trace it did not look at (not due yet). A verifier that looks answers with
# its own name and score, even to continue, so a weighted combination can tell the two apart.
NOT_CHECKED = Verdict(Action.CONTINUE)


@dataclass
class Trace:
    """One choice of a request, as far as it has been generated."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # empty unless the verifiers asked for them
    finished: bool = False
    finish_reason: str | None = None
    state: dict[Any, Any] = field(default_factory=dict)  # verifiers' incremental state, keyed by their names

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Ask(Protocol):
    """The tier that served the answer, asked something else (blocking): a chat's `messages` → the reply's
    text, at most `max_tokens` long. Final checks get one in `Context.ask` (`verifiers.ask`); it raises
    `AskFailed` when the tier cannot answer."""

    def __call__(self, messages: Sequence[Mapping[str, str]], max_tokens: int, temperature: float = 0.0) -> str: ...


class AskFailed(RuntimeError):
    """The tier could not answer a check's question (too long, down, failed); not the answer's fault."""


@dataclass(frozen=True)
class Context:
    """The request the traces answer."""

    prompt: str = ""  # the last user message, or the completion prompt
    messages: Sequence[Mapping[str, Any]] = ()
    response_format: Mapping[str, Any] | None = None
    tests: str | None = None  # code that checks a code answer (raises on failure), if the caller gave it
    reference: str | None = None  # a known answer, where there is one (benchmarks)
    ask: Ask | None = None  # final checks only: the serving tier, to ask a question of its own (`Ask`)


class Verifier:
    """Base: a name, how often it looks (`every` tokens; 0 = when finished) and how many alternatives
    per token it needs in `Trace.logprobs` (0: none)."""

    name: str = "verifier"
    every: int = 0
    top_logprobs: int = 0

    def check(self, context: Context, traces: Sequence[Trace]) -> list[Verdict]:
        """One verdict per trace, in order."""
        raise NotImplementedError

    def due(self, trace: Trace) -> bool:
        """Whether this trace should be checked now: finished, or `every` tokens since its last check
        (a speculative step can add several tokens at once, so not "at multiples of")."""
        if trace.finished:
            return not trace.state.get(("final", self.name), False)  # judged once when finished
        return self.every > 0 and trace.num_tokens - trace.state.get(("checked", self.name), 0) >= self.every

    def mark_checked(self, trace: Trace) -> None:
        trace.state[("checked", self.name)] = trace.num_tokens
        if trace.finished:
            trace.state[("final", self.name)] = True


class TraceVerifier(Verifier):
    """A verifier of one trace at a time."""

    def check(self, context: Context, traces: Sequence[Trace]) -> list[Verdict]:
        verdicts = []
        for t in traces:
            if self.due(t):
                self.mark_checked(t)
                verdicts.append(self.check_trace(context, t))
            else:
                verdicts.append(NOT_CHECKED)
        return verdicts

    def check_trace(self, context: Context, trace: Trace) -> Verdict:
        raise NotImplementedError

    def verdict(self, action: Action, score: float, reason: str) -> Verdict:
        return Verdict(action, score, reason, self.name)

    def not_run(self, why: object) -> Verdict:
        """The check could not run here (`grading.sandbox.JailUnavailable`): the answer is served without it."""
        return self.verdict(Action.UNAVAILABLE, 1.0, f"not run: no jail for code on this machine: {why}"[:240])
