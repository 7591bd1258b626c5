"""Verifiers inside the engine's step loop: the `GenerationHook` a request carries.

One hook per request, shared by its n choices (a self-consistency vote sees them all). The engine shows
it every step's outputs; the hook keeps each choice's trace (tokens, text, logprobs) and, when the
verifier says so, ends running choices through the engine's abort path: stop (kept), prune (dropped)
or escalate. Verdicts on finished choices are kept too (`final`): a final-only verifier's escalate is
what a cascade acts on. Every non-continue verdict is recorded once per choice (`actions`), for the
response header and the usage row; `unavailable` (a check that could not run) is recorded and acts as continue.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from engines.request import FinishReason, RequestOutput
from verifiers.base import NOT_CHECKED, PASSES, Action, Ask, Context, Trace, Verdict, Verifier

ENDS = {Action.STOP: FinishReason.STOP, Action.PRUNE: FinishReason.PRUNED, Action.ESCALATE: FinishReason.ESCALATE}


class VerifierHook:
    def __init__(
        self, verifier: Verifier | None, context: Context, request_ids: Sequence[str], checks: Verifier | None = None
    ) -> None:
        """`verifier`: in-flight (the engine's step loop); `checks`: final, run by `run_checks` off that loop."""
        self.verifier = verifier
        self.checks = checks
        self.context = context
        self.traces = {rid: Trace(i) for i, rid in enumerate(request_ids)}
        self.final: dict[int, Verdict] = {}  # choice index → the verdict on its finished trace
        self.actions: list[dict[str, Any]] = []  # non-continue verdicts, each choice's first of each kind
        self._failed_checks = 0
        self._ended: dict[str, Verdict] = {}  # choices the hook ended, with the verdict that did
        self._lock = threading.Lock()  # the engine thread writes, the gateway reads `actions` at the end

    @property
    def top_logprobs(self) -> int:
        return self.verifier.top_logprobs if self.verifier is not None else 0

    def observe(self, output: RequestOutput) -> None:
        trace = self.traces.get(output.request_id)
        if trace is None:
            return
        trace.token_ids += output.new_token_ids
        trace.text += output.text
        trace.logprobs += output.logprobs
        if output.finish_reason is not None:
            trace.finished, trace.finish_reason = True, output.finish_reason.value

    def decide(self) -> Mapping[str, FinishReason]:
        if self.verifier is None:
            return {}
        traces = list(self.traces.items())
        if all(rid in self._ended or (t.finished and t.index in self.final) for rid, t in traces):
            return {}
        # All of them, ended ones included (finish reason `verifier-<action>`): a vote needs the finished
        # traces, a confidence ranking the pruned ones; each verifier knows what it has judged.
        verdicts = self.verifier.check(self.context, [t for _, t in traces])
        ends: dict[str, FinishReason] = {}
        for (rid, trace), verdict in zip(traces, verdicts, strict=True):
            if verdict is NOT_CHECKED or rid in self._ended or (trace.finished and trace.index in self.final):
                continue
            if trace.finished:
                self.final[trace.index] = verdict
            if verdict.action is Action.CONTINUE:
                continue
            self._record(trace, verdict)
            if verdict.action is Action.UNAVAILABLE:
                continue
            if not trace.finished:
                ends[rid] = ENDS[verdict.action]
                self._ended[rid] = verdict
                trace.finished, trace.finish_reason = True, f"verifier-{verdict.action}"
        return ends

    def _record(self, trace: Trace, verdict: Verdict) -> None:
        with self._lock:
            self.actions.append({"choice": trace.index, "tokens": trace.num_tokens, **verdict.as_dict()})

    def run_checks(self, ask: Ask | None = None) -> None:
        """The final answer checks, on every choice that ended by itself (blocking: run it on a worker thread);
        `ask`: the serving tier, for checks that ask it something (`Context.ask`)."""
        if self.checks is None:
            return
        context = self.context if ask is None else replace(self.context, ask=ask)
        done = [t for rid, t in self.traces.items() if t.finished and rid not in self._ended]  # ended by themselves
        for trace, verdict in zip(done, self.checks.check(context, done), strict=True):
            if verdict.action is not Action.CONTINUE:
                self._record(trace, verdict)
            if verdict.action not in PASSES:
                with self._lock:
                    self._failed_checks += 1

    def ended_by_verifier(self, request_id: str) -> bool:
        return request_id in self._ended

    @property
    def failed(self) -> bool:
        """Whether an answer of this request failed: a check escalated it, or a loop had to be stopped."""
        verdicts = [*self.final.values(), *self._ended.values()]
        looped = any(v.action is Action.STOP and v.verifier == "degeneration" for v in verdicts)
        return self._failed_checks > 0 or looped or any(v.action is Action.ESCALATE for v in verdicts)

    def tokens_saved(self, max_tokens: Mapping[str, int]) -> int:
        """An estimate of the completion tokens the ended choices did not generate: a loop runs to its cap
        (`max_tokens` by request id); another ended choice, to the mean length of the choices that finished
        (nothing if none did)."""
        finished = [t.num_tokens for rid, t in self.traces.items() if t.finished and rid not in self._ended]
        typical = sum(finished) / len(finished) if finished else 0.0
        saved = 0.0
        for rid, verdict in self._ended.items():
            trace = self.traces[rid]
            if verdict.verifier == "degeneration":
                saved += max(0, max_tokens.get(rid, trace.num_tokens) - trace.num_tokens)
            else:
                saved += max(0.0, typical - trace.num_tokens)
        return round(saved)

    def summary(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.actions)
