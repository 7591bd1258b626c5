"""DeepConf-style confidence over the choices of one request, and self-consistency voting.

Token confidence (DeepConf): minus the mean log-probability of the k most likely tokens at a position;
a peaked distribution (the model is sure) gives a high value. A trace's group confidence is that value
averaged over a sliding window of `window` tokens; its lowest group confidence so far is what marks a
trace whose reasoning went astray (DeepConf prunes on it).

`Confidence` judges the n choices of one request together, every `every` tokens:
- prune: a running trace whose lowest group confidence falls below `threshold` (calibrated offline per
  tier, DeepConf's percentile of warm-up traces), or, without a threshold, below the `prune_quantile` of
  the lowest confidences of all the request's traces (by rank; ties kept), never leaving fewer than
  `min_keep` traces alive;
- stop: once the finished traces' vote has converged, every trace still running. Votes are weighted by
  each trace's mean confidence; the vote has converged when the leading answer holds at least
  `consensus` of the finished weight and at least `min_votes` traces, or when the traces still running
  could not overturn it even if they all agreed on another answer.

Answers are compared by `answer_of` (default: the final number, as GSM8K is graded; else the stripped
text).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from grading.answers import extract_answer
from verifiers.base import NOT_CHECKED, Action, Context, Trace, Verdict, Verifier


def token_confidence(top: Sequence[tuple[int, float]]) -> float:
    """Minus the mean log-probability of the listed alternatives (DeepConf's C_i)."""
    return -sum(lp for _, lp in top) / len(top) if top else 0.0


def final_answer(text: str) -> str | None:
    """The final number (GSM8K's rule), else the whitespace-normalized text; None for an empty answer."""
    return extract_answer(text) or " ".join(text.split()) or None


@dataclass
class _Running:
    """Incremental group confidence of one trace."""

    seen: int = 0  # logprobs consumed
    window: deque[float] = field(default_factory=deque)
    total: float = 0.0  # sum over the window
    lowest: float = math.inf  # lowest full-window mean so far (or the partial mean while shorter)
    sum_all: float = 0.0

    def update(self, trace: Trace, size: int) -> None:
        for lp in trace.logprobs[self.seen :]:
            c = token_confidence(lp.top)
            self.window.append(c)
            self.total += c
            self.sum_all += c
            if len(self.window) > size:
                self.total -= self.window.popleft()
            if len(self.window) == size:
                self.lowest = min(self.lowest, self.total / size)
        self.seen = len(trace.logprobs)

    def lowest_or_partial(self) -> float:
        if math.isfinite(self.lowest):
            return self.lowest
        return self.total / len(self.window) if self.window else math.inf

    @property
    def mean(self) -> float:
        return self.sum_all / self.seen if self.seen else 0.0


class Confidence(Verifier):
    name = "confidence"

    def __init__(
        self,
        *,
        every: int = 16,
        top_logprobs: int = 5,
        window: int = 64,
        threshold: float | None = None,
        prune_quantile: float = 0.25,
        min_keep: int = 2,
        consensus: float = 0.95,
        min_votes: int = 3,
        answer_of: Callable[[str], str | None] = final_answer,
    ) -> None:
        self.every, self.top_logprobs, self.window = every, top_logprobs, window
        self.threshold, self.prune_quantile, self.min_keep = threshold, prune_quantile, min_keep
        self.consensus, self.min_votes, self.answer_of = consensus, min_votes, answer_of

    def check(self, context: Context, traces: Sequence[Trace]) -> list[Verdict]:
        if not any(self.due(t) for t in traces):
            return [NOT_CHECKED] * len(traces)
        states = []
        for t in traces:
            self.mark_checked(t)
            state = t.state.setdefault(self.name, _Running())
            state.update(t, self.window)
            states.append(state)
        verdicts = [Verdict(Action.CONTINUE, s.mean, "", self.name) for s in states]
        running = [i for i, t in enumerate(traces) if not t.finished]
        if not running:
            return verdicts
        # the vote: finished traces that gave an answer, weighted by their confidence
        votes: dict[str, float] = {}
        counts: dict[str, int] = {}
        for t, s in zip(traces, states, strict=True):
            if t.finished and not _ended_early(t) and (a := self.answer_of(t.text)):
                votes[a] = votes.get(a, 0.0) + max(s.mean, 1e-6)
                counts[a] = counts.get(a, 0) + 1
        if votes:
            leader = max(votes, key=votes.__getitem__)
            share = votes[leader] / sum(votes.values())
            runner_up = max((c for a, c in counts.items() if a != leader), default=0)
            settled = counts[leader] > runner_up + len(running)  # the rest cannot overturn it
            if settled or (share >= self.consensus and counts[leader] >= self.min_votes):
                reason = f"the vote converged on {leader!r} ({counts[leader]} of {sum(counts.values())} finished)"
                for i in running:
                    verdicts[i] = Verdict(Action.STOP, share, reason, self.name)
                return verdicts
        # pruning: the least confident running traces, keeping at least `min_keep` alive or done well
        alive = [i for i, t in enumerate(traces) if not _ended_early(t)]
        lows = {i: states[i].lowest_or_partial() for i in range(len(traces))}
        if self.threshold is not None:
            cut = self.threshold
        else:  # ranked among all the request's traces, pruned ones too: the cut does not creep up as they go
            ranked = sorted(v for v in lows.values() if math.isfinite(v))
            if len(ranked) < 2:
                return verdicts
            # the lowest `prune_quantile` share, by rank: strictly below the next one up (ties are kept)
            cut = ranked[min(math.ceil(self.prune_quantile * len(ranked)), len(ranked) - 1)]
        may_prune = len(alive) - self.min_keep
        for i in sorted(running, key=lambda i: lows[i]):
            if may_prune <= 0 or not lows[i] < cut or traces[i].num_tokens < self.window:
                continue
            verdicts[i] = Verdict(
                Action.PRUNE, lows[i], f"lowest group confidence {lows[i]:.3f} < {cut:.3f}", self.name
            )
            may_prune -= 1
        return verdicts


def _ended_early(trace: Trace) -> bool:
    """Ended by a verifier (pruned, stopped, escalated) rather than by itself: no answer to count."""
    return (trace.finish_reason or "").startswith("verifier-") or trace.finish_reason in ("pruned", "escalate")
