"""Checks of a finished answer: a final number for math, the caller's unit tests for code, valid JSON
or a full regex match for structured answers. Each is final-only (it looks once the choice has ended)
and says `escalate` when the answer fails, `continue` (score 1) when it passes: on a cascade, a failed
small-tier answer is retried on the large tier.

- `MathAnswer`: the answer must end in a number (`grading.answers`' GSM8K rule); with a reference
  (benchmarks), it must equal it.
- `CodeTests`: the code in the answer (a fenced block, else the text) and `Context.tests` run together
  in `grading.sandbox`'s jail; passing means exit status 0. Without tests there is nothing to check; without
  a jail on this machine it does not run (`unavailable`).
- `Structure`: JSON that parses (and matches `response_format`'s schema, if it has one), or a full
  match of its regex. Constrained decoding makes this hold by construction on our engines; it catches
  answers cut off by `max_tokens` and answers from tiers that cannot constrain (remote ones).
"""

from __future__ import annotations

import json
import re

from grading.answers import answer_code, extract_answer, reference_answer
from grading.sandbox import JailUnavailable, run_python
from verifiers.base import Action, Context, Trace, TraceVerifier, Verdict


class MathAnswer(TraceVerifier):
    name = "math"

    def check_trace(self, context: Context, trace: Trace) -> Verdict:
        answer = extract_answer(trace.text)
        if answer is None:
            return self.verdict(Action.ESCALATE, 0.0, "no final number")
        if context.reference is not None:
            expected = reference_answer(context.reference) or extract_answer(context.reference)
            if answer != expected:
                return self.verdict(Action.ESCALATE, 0.0, f"final number {answer} is not {expected}")
        return self.verdict(Action.CONTINUE, 1.0, f"final number {answer}")


class CodeTests(TraceVerifier):
    name = "code"

    def __init__(self, timeout: float = 10.0) -> None:
        self.timeout = timeout

    def check_trace(self, context: Context, trace: Trace) -> Verdict:
        if not context.tests:
            return self.verdict(Action.CONTINUE, 1.0, "no tests to run")
        try:
            result = run_python(f"{answer_code(trace.text)}\n\n{context.tests}\n", timeout=self.timeout)
        except JailUnavailable as exc:
            return self.not_run(exc)
        if result.passed:
            return self.verdict(Action.CONTINUE, 1.0, "tests pass")
        why = "timed out" if result.timed_out else (result.stderr.strip().splitlines() or ["failed"])[-1][:200]
        return self.verdict(Action.ESCALATE, 0.0, f"tests fail: {why}")


class Structure(TraceVerifier):
    name = "structure"

    def check_trace(self, context: Context, trace: Trace) -> Verdict:
        fmt = context.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "regex":
            ok = re.fullmatch(str(fmt.get("regex", "")), trace.text) is not None
            return self.verdict(
                Action.CONTINUE if ok else Action.ESCALATE, float(ok), "regex" + ("" if ok else " mismatch")
            )
        if kind not in ("json_object", "json_schema"):
            return self.verdict(Action.CONTINUE, 1.0, "free text")
        try:
            value = json.loads(trace.text)
        except ValueError as exc:
            return self.verdict(Action.ESCALATE, 0.0, f"not JSON: {exc}")
        if kind == "json_object" and not isinstance(value, dict):
            return self.verdict(Action.ESCALATE, 0.0, "not a JSON object")
        if kind == "json_schema":
            import jsonschema

            schema = (fmt.get("json_schema") or {}).get("schema", {})
            try:
                jsonschema.validate(value, schema)
            except jsonschema.ValidationError as exc:
                return self.verdict(Action.ESCALATE, 0.0, f"schema: {exc.message[:200]}")
            except jsonschema.SchemaError:
                pass  # the compiler accepted what jsonschema calls malformed: the grammar was the check
        return self.verdict(Action.CONTINUE, 1.0, "valid")
