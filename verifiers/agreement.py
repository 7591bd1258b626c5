"""Math answers checked against a second opinion of the same tier: `program_of_thought` and `resample`.

Both take the chain-of-thought answer's final number (`grading.answers.extract_answer`; an answer without
one escalates, as `math` does) and ask the tier that served it again, through `Context.ask`:

- `ProgramOfThought`: for a Python program that prints the answer (program of thought, Chen et al. 2022;
  the problem first, then the instruction, so that it wins over the problem's own), its first Python
  block run in `grading.sandbox`. It escalates when the program fails (error, timeout, no number printed) or
  prints another number. A short program is far fewer tokens than a second chain of thought, and its
  mistakes are of another kind (arithmetic is exact, reading the problem is not).
- `Resample`: for a second chain of thought, sampled (temperature 0.7); it escalates when its final
  number differs (self-consistency with two samples).

Numbers agree when equal within 1e-9 (relative), or when the second one rounded to the first one's
decimals equals it (a program prints 3.3333333 where the answer says 3.33). Without `Context.ask` (no
tier to ask: policy tuning) or when the tier cannot answer (`AskFailed`), they continue and say why: that
is not the answer's fault. Where this machine has no jail, `program_of_thought` asks nothing and says
`unavailable`.
"""

from __future__ import annotations

from decimal import Decimal

from grading.answers import extract_answer, fenced_blocks
from grading.sandbox import JailUnavailable, jail_status, run_python
from verifiers.base import Action, AskFailed, Context, Trace, TraceVerifier, Verdict

# The problem first, the instruction last: it must win over the problem's own ("end with 'The answer is N'").
POT_TEMPLATE = (
    "{question}\n\nDo not solve it in words: write a Python program that computes the answer and prints only "
    "the final number. Reply with one ```python block."
)
_PYTHON_TAGS = ("", "python", "python3", "py")


def program(reply: str) -> str:
    """The program in a reply: its first Python block (a reply may go on to imagine its output in another),
    else the whole text."""
    blocks = [code for tag, code in fenced_blocks(reply) if tag.lower() in _PYTHON_TAGS]
    return blocks[0] if blocks else reply


def agree(answer: str, other: str) -> bool:
    """Whether two canonical numbers (`extract_answer`'s) are the same answer (see the module's docstring)."""
    a, b = Decimal(answer), Decimal(other)
    if abs(a - b) <= Decimal("1e-9") * max(Decimal(1), abs(a)):
        return True
    places = -a.as_tuple().exponent if isinstance(a.as_tuple().exponent, int) else 0
    return 0 < places <= 4 and round(b, places) == a


class _Agreement(TraceVerifier):
    def check_trace(self, context: Context, trace: Trace) -> Verdict:
        answer = extract_answer(trace.text)
        if answer is None:
            return self.verdict(Action.ESCALATE, 0.0, "no final number")
        if context.ask is None:
            return self.verdict(Action.CONTINUE, 1.0, f"final number {answer}; no tier to ask")
        try:
            other, why = self.second_opinion(context)
        except AskFailed as exc:
            return self.verdict(Action.CONTINUE, 1.0, f"final number {answer}; could not ask: {str(exc)[:160]}")
        except JailUnavailable as exc:
            return self.not_run(exc)
        if other is None:
            return self.verdict(Action.ESCALATE, 0.0, why)
        if not agree(answer, other):
            return self.verdict(Action.ESCALATE, 0.0, f"{why} {other}, the answer {answer}")
        return self.verdict(Action.CONTINUE, 1.0, f"{why} {other} too")

    def second_opinion(self, context: Context) -> tuple[str | None, str]:
        """(the second number, or None if there is none; what says it, or why there is none)."""
        raise NotImplementedError


class ProgramOfThought(_Agreement):
    name = "program_of_thought"

    def __init__(self, max_tokens: int = 384, timeout: float = 5.0) -> None:
        self.max_tokens = max_tokens
        self.timeout = timeout

    def second_opinion(self, context: Context) -> tuple[str | None, str]:
        assert context.ask is not None
        if not jail_status().available:  # before asking: a program that cannot run is not worth its tokens
            raise JailUnavailable(jail_status().reason)
        question = [{"role": "user", "content": POT_TEMPLATE.format(question=context.prompt.strip())}]
        reply = context.ask(question, self.max_tokens)
        result = run_python(program(reply), timeout=self.timeout)
        if not result.passed:
            lines = result.stderr.strip().splitlines() or ["failed"]
            return None, "the program " + ("timed out" if result.timed_out else f"fails: {lines[-1][:200]}")
        printed = extract_answer(result.stdout)
        return printed, "the program prints" if printed is not None else "the program prints no number"


class Resample(_Agreement):
    name = "resample"

    def __init__(self, max_tokens: int = 512, temperature: float = 0.7) -> None:
        self.max_tokens = max_tokens
        self.temperature = temperature

    def second_opinion(self, context: Context) -> tuple[str | None, str]:
        assert context.ask is not None
        messages = list(context.messages) or [{"role": "user", "content": context.prompt}]
        other = extract_answer(context.ask(messages, self.max_tokens, self.temperature))
        return other, "a second sample says" if other is not None else "a second sample ends in no number"
