"""`prompt_examples`: a code answer must pass the examples its own prompt gives.

Many code prompts carry their tests: HumanEval-style docstring doctests (`>>> f(1)` then `2`), `assert`
lines, and `f(1) ==> 2` lines (`grading.examples` says which forms count and why). The check takes them
from the prompt, runs them against the answer's code (after the prompt's own code, so its imports and
helpers stay) in `grading.sandbox`, and escalates if one fails or the run times out. A prompt without
examples of a function the prompt or the answer defines has nothing to check: it continues, saying so.
No tests from the caller are needed (that is the `code` check). Where this machine has no jail the check
does not run: it says `unavailable` and the answer is served without it.
"""

from __future__ import annotations

from grading.answers import answer_code
from grading.examples import defined_functions, prompt_code, prompt_examples, run_examples, solution
from grading.sandbox import JailUnavailable
from verifiers.base import Action, Context, Trace, TraceVerifier, Verdict

NO_EXAMPLES = "the prompt gives no examples to run"


class PromptExamples(TraceVerifier):
    name = "prompt_examples"

    def __init__(self, timeout: float = 10.0) -> None:
        self.timeout = timeout

    def check_trace(self, context: Context, trace: Trace) -> Verdict:
        prompt = context.prompt
        functions = defined_functions(prompt_code(prompt)) | defined_functions(answer_code(trace.text))
        examples = prompt_examples(prompt, functions)
        if not examples:
            return self.verdict(Action.CONTINUE, 1.0, NO_EXAMPLES)
        try:
            result = run_examples(solution(prompt, trace.text, functions), examples, timeout=self.timeout)
        except JailUnavailable as exc:  # the prompt's code and the answer's are never run unjailed
            return self.not_run(exc)
        if result.passed:
            return self.verdict(Action.CONTINUE, 1.0, f"{len(examples)} prompt examples pass")
        lines = result.stderr.strip().splitlines() or ["failed"]
        why = "timed out" if result.timed_out else lines[-1][:240]
        return self.verdict(Action.ESCALATE, 0.0, f"prompt examples fail: {why}")
