"""Verifiers combined: `any_of`, `all_of` and `weighted`.

- `any_of(a, b, ...)`: each trace gets the most drastic action any member asks for (escalate > prune >
  stop > unavailable > continue), with that member's verdict; ties go to the first member listed.
- `all_of(a, b, ...)`: a trace is acted on only if every member asks for some action; the action is the
  mildest of theirs and the score the lowest (every member must agree that something is wrong).
- `weighted((a, 2.0), (b, 1.0), threshold=0.5, action=ESCALATE)`: the members' scores (each on 0-1)
  averaged with the weights; below `threshold` the trace gets `action`, else it continues. Members
  that have not looked at a trace yet (not due), or could not (unavailable), do not count in its average.

A combination looks as often as its most frequent member (`every`) and asks for as many alternatives
per token as its neediest one.
"""

from __future__ import annotations

from collections.abc import Sequence

from verifiers.base import NOT_CHECKED, PASSES, SEVERITY, Action, Context, Trace, Verdict, Verifier


class _Combined(Verifier):
    def __init__(self, members: Sequence[Verifier], name: str) -> None:
        if not members:
            raise ValueError(f"{name} needs at least one verifier")
        self.members = list(members)
        self.name = name
        everies = [m.every for m in self.members if m.every > 0]
        self.every = min(everies) if everies else 0
        self.top_logprobs = max(m.top_logprobs for m in self.members)

    def _all_verdicts(self, context: Context, traces: Sequence[Trace]) -> list[list[Verdict]]:
        """Per member, its verdicts for every trace."""
        return [m.check(context, traces) for m in self.members]


class AnyOf(_Combined):
    def __init__(self, *members: Verifier) -> None:
        super().__init__(members, "any(" + ",".join(m.name for m in members) + ")")

    def check(self, context: Context, traces: Sequence[Trace]) -> list[Verdict]:
        out = []
        for per_trace in zip(*self._all_verdicts(context, traces), strict=True):
            out.append(max(per_trace, key=lambda v: SEVERITY[v.action]))  # max keeps the first of equals
        return out


class AllOf(_Combined):
    def __init__(self, *members: Verifier) -> None:
        super().__init__(members, "all(" + ",".join(m.name for m in members) + ")")

    def check(self, context: Context, traces: Sequence[Trace]) -> list[Verdict]:
        out = []
        for per_trace in zip(*self._all_verdicts(context, traces), strict=True):
            if any(v.action in PASSES for v in per_trace):
                out.append(
                    NOT_CHECKED
                    if all(v is NOT_CHECKED for v in per_trace)
                    else Verdict(Action.CONTINUE, min(v.score for v in per_trace), "", self.name)
                )
                continue
            mildest = min(per_trace, key=lambda v: SEVERITY[v.action])
            reasons = "; ".join(f"{v.verifier}: {v.reason}" for v in per_trace)
            out.append(Verdict(mildest.action, min(v.score for v in per_trace), reasons, self.name))
        return out


class Weighted(_Combined):
    def __init__(
        self, *members: tuple[Verifier, float], threshold: float = 0.5, action: Action = Action.ESCALATE
    ) -> None:
        if any(w < 0 for _, w in members) or not any(w > 0 for _, w in members):
            raise ValueError("weights must be non-negative and not all zero")
        super().__init__([m for m, _ in members], "weighted(" + ",".join(m.name for m, _ in members) + ")")
        self.weights = [w for _, w in members]
        self.threshold = threshold
        self.action = action

    def check(self, context: Context, traces: Sequence[Trace]) -> list[Verdict]:
        out = []
        for per_trace in zip(*self._all_verdicts(context, traces), strict=True):
            looked = [
                (v, w)
                for v, w in zip(per_trace, self.weights, strict=True)
                if v is not NOT_CHECKED and v.action is not Action.UNAVAILABLE  # did not look, or could not
            ]
            total = sum(w for _, w in looked)
            if not total:
                out.append(NOT_CHECKED)
                continue
            score = sum(v.score * w for v, w in looked) / total
            if score < self.threshold:
                reason = f"weighted score {score:.3f} < {self.threshold}"
                out.append(Verdict(self.action, score, reason, self.name))
            else:
                out.append(Verdict(Action.CONTINUE, score, "", self.name))
        return out


def any_of(*members: Verifier) -> Verifier:
    return AnyOf(*members)


def all_of(*members: Verifier) -> Verifier:
    return AllOf(*members)


def weighted(*members: tuple[Verifier, float], threshold: float = 0.5, action: Action = Action.ESCALATE) -> Verifier:
    return Weighted(*members, threshold=threshold, action=action)
