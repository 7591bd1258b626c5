"""The checks per kind of request: a code answer against its prompt's examples (`prompt_examples`), a math
answer against the same tier's program or second sample (`program_of_thought`, `resample`), and the
`ask` callable that reaches the tier. Each escalates a known-wrong answer and passes a known-right one."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from grading.examples import Example, defined_functions, prompt_code, prompt_examples
from policies.policy import VerifierSettings
from verifiers.agreement import POT_TEMPLATE, ProgramOfThought, Resample, agree
from verifiers.base import Action, AskFailed, Context, Trace, Verdict
from verifiers.hook import VerifierHook
from verifiers.policy import build_verifiers
from verifiers.prompt_examples import NO_EXAMPLES, PromptExamples

HUMANEVAL_STYLE = '''Complete the following Python function. Reply with the whole function in one ```python block.

```python
from typing import List


def running_max(xs: List[int]) -> List[int]:
    """ The largest value so far, at each position.
    >>> running_max([1, 3, 2, 5])
    [1, 3, 3, 5]
    >>> running_max([])
    []
    """
```'''
BODY = """    out, best = [], None
    for x in xs:
        best = x if best is None else max(best, x)
        out.append(best)
    return out
"""
RIGHT_CODE = f"```python\ndef running_max(xs):\n{BODY}```"
WRONG_CODE = "```python\ndef running_max(xs):\n    return sorted(xs)\n```"


def answered(text: str) -> Trace:
    return Trace(0, [1, 2, 3], text, finished=True, finish_reason="stop")


def check(verifier: PromptExamples | ProgramOfThought | Resample, prompt: str, answer: str, **ctx: object) -> Verdict:
    return verifier.check(Context(prompt=prompt, **ctx), [answered(answer)])[0]  # type: ignore[arg-type]


# --- examples taken from a prompt ------------------------------------------------------------------------


def test_doctests_are_parsed_with_the_stdlib_parser_and_asserts_and_arrows_where_unambiguous() -> None:
    functions = defined_functions(prompt_code(HUMANEVAL_STYLE))
    assert functions == {"running_max"}
    assert prompt_examples(HUMANEVAL_STYLE, functions) == [
        Example("running_max([1, 3, 2, 5])", "[1, 3, 3, 5]\n", "doctest"),
        Example("running_max([])", "[]\n", "doctest"),
    ]
    arrows = """Write a function `fly(q, w)`.
    fly([1, 2], 5) ➞ False
    * fly([3], 5) => true
    fly([3, 2, 3], 9) should return True.
    fly(x, 3) ==> False
    fly([1], 1) -> 1 + 0 = 1
    fly([2], 2) ==> ("Venus")
    other([1], 2) ==> True
assert fly([9], 9) == True
"""
    got = prompt_examples(arrows, {"fly"})
    assert [(e.source, e.want, e.kind) for e in got] == [
        ("assert fly([9], 9) == True", "", "assert"),
        ("fly([1, 2], 5)", "False", "arrow"),
        ("fly([3], 5)", "True", "arrow"),  # `true` read as a boolean
        ("fly([3, 2, 3], 9)", "True", "arrow"),  # the trailing period dropped
    ]  # not: a name argument, an expression, a parenthesized string, a function nobody defines


def test_only_examples_of_a_function_the_prompt_or_answer_defines_count() -> None:
    shell = "Why does Python print 2 here?\n>>> 1 + 1\n2\n"
    assert prompt_examples(shell, set()) == []
    assert prompt_examples("Write is_even.\n>>> is_even(2)\nTrue\n", {"is_even"})[0].source == "is_even(2)"


def test_a_comparison_without_output_is_an_assertion_and_escapes_stay_escaped() -> None:
    prompt = 'def f(s):\n    """\n    >>> f("a\\nb") == 2\n    """\n'  # the docstring holds `\n` as written
    (ex,) = prompt_examples(prompt, {"f"})
    assert ex == Example('assert f("a\\nb") == 2', "", "doctest")


# --- prompt_examples ---------------------------------------------------------------------------------------


def test_prompt_examples_pass_a_right_answer_and_escalate_a_wrong_one() -> None:
    v = PromptExamples()
    ok = check(v, HUMANEVAL_STYLE, RIGHT_CODE)
    assert ok.action is Action.CONTINUE and ok.reason == "2 prompt examples pass"
    bad = check(v, HUMANEVAL_STYLE, WRONG_CODE)
    assert bad.action is Action.ESCALATE and bad.verifier == "prompt_examples"
    assert "running_max([1, 3, 2, 5]): expected '[1, 3, 3, 5]', got '[1, 2, 3, 5]'" in bad.reason
    # a body alone goes under the prompt's signature, as HumanEval grading does
    assert check(v, HUMANEVAL_STYLE, BODY).action is Action.CONTINUE
    assert check(v, HUMANEVAL_STYLE, "I cannot help with that.").action is Action.ESCALATE  # prose, no code


def test_prompt_examples_accept_equal_values_written_differently() -> None:
    prompt = 'Write pair(s).\n>>> pair(\'ab\')\n["a","b"]\n>>> half(3)\n1.5000000001\n'
    code = "```python\ndef pair(s):\n    return list(s)\n\ndef half(n):\n    return n / 2\n```"
    assert check(PromptExamples(), prompt, code).action is Action.CONTINUE


def test_prompt_examples_continue_without_examples_and_escalate_on_a_timeout() -> None:
    free = check(PromptExamples(), "Write a haiku about caches.", "Caches hold the past")
    assert free.action is Action.CONTINUE and free.reason == NO_EXAMPLES
    loop = "```python\ndef running_max(xs):\n    while True:\n        pass\n```"
    slow = check(PromptExamples(timeout=1.0), HUMANEVAL_STYLE, loop)
    assert slow.action is Action.ESCALATE and slow.reason == "prompt examples fail: timed out"


def test_shadow_and_explore_judges_run_the_prompts_examples_on_a_cheaper_answer() -> None:
    """`grading.examples.passes_prompt_examples`, which shadow and explore runs judge a code answer by before asking
    the large tier: the verifier's verdict as a bool, None where the prompt gives nothing to run."""
    from grading.examples import passes_prompt_examples

    assert passes_prompt_examples(HUMANEVAL_STYLE, RIGHT_CODE) is True
    assert passes_prompt_examples(HUMANEVAL_STYLE, BODY) is True
    assert passes_prompt_examples(HUMANEVAL_STYLE, WRONG_CODE) is False
    assert passes_prompt_examples(HUMANEVAL_STYLE, "I cannot help with that.") is False
    assert passes_prompt_examples("Write a haiku about caches.", "Caches hold the past") is None


def test_prompt_examples_on_every_humaneval_reference_solution() -> None:
    """HumanEval's own solutions pass their prompts' examples, but for the two prompts whose examples are
    wrong (47: a wrong median; 116: asserts its tests contradict); a stub that returns None never does."""
    from grading.datasets import load_humaneval_items

    home = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()  # as conftest's
    v = PromptExamples()
    failed, checked, stubs_passed = [], 0, []
    for item in load_humaneval_items(home):
        g = item.grading
        verdict = check(v, item.question, f"```python\n{g['prompt']}{g['canonical_solution']}```")
        if verdict.reason == NO_EXAMPLES:
            continue
        checked += 1
        if verdict.action is Action.ESCALATE:
            failed.append(item.id)
        stub = check(v, item.question, f"```python\n{g['prompt']}    return None\n```")
        if stub.action is not Action.ESCALATE:
            stubs_passed.append(item.id)
    assert checked >= 130  # of 164: the rest give no example in a form taken
    assert failed == ["humaneval/HumanEval-47", "humaneval/HumanEval-116"]
    assert stubs_passed == []


# --- program_of_thought and resample -----------------------------------------------------------------------

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"


class FakeTier:
    """An `Ask` that answers from a script, and records what it was asked."""

    def __init__(self, *replies: str, fail: bool = False) -> None:
        self.replies, self.fail = list(replies), fail
        self.asked: list[tuple[list[dict], int, float]] = []

    def __call__(self, messages: Sequence[Mapping[str, str]], max_tokens: int, temperature: float = 0.0) -> str:
        self.asked.append(([dict(m) for m in messages], max_tokens, temperature))
        if self.fail:
            raise AskFailed("the tier is down")
        return self.replies.pop(0)


PROGRAM = "```python\napples = 3 + 4\nprint(apples)\n```"


def test_program_of_thought_passes_agreement_and_escalates_disagreement() -> None:
    tier = FakeTier(PROGRAM, PROGRAM)
    right = check(ProgramOfThought(), QUESTION, "3 + 4 = 7. The answer is 7.", ask=tier)
    assert right.action is Action.CONTINUE and right.reason == "the program prints 7 too"
    wrong = check(ProgramOfThought(), QUESTION, "3 + 4 = 8. The answer is 8.", ask=tier)
    assert wrong.action is Action.ESCALATE and wrong.reason == "the program prints 7, the answer 8"
    chatty = "Let me write it.\n```python\nprint(3 + 4)\n```\n```output\n13\n```\nSo it is 13."
    told = check(ProgramOfThought(), QUESTION, "The answer is 7.", ask=FakeTier(chatty))
    assert told.reason == "the program prints 7 too"  # its first Python block ran, not its imagined output
    (messages, max_tokens, temperature), _ = tier.asked
    assert messages == [{"role": "user", "content": POT_TEMPLATE.format(question=QUESTION)}]
    assert (max_tokens, temperature) == (384, 0.0)  # greedy


@pytest.mark.parametrize(
    ("program", "reason"),
    [
        ("```python\nprint(1 / 0)\n```", "the program fails: ZeroDivisionError: division by zero"),
        ("```python\nprint('seven')\n```", "the program prints no number"),
        ("```python\nwhile True:\n    pass\n```", "the program timed out"),
    ],
)
def test_program_of_thought_escalates_when_the_program_fails(program: str, reason: str) -> None:
    v = check(ProgramOfThought(timeout=1.0), QUESTION, "The answer is 7.", ask=FakeTier(program))
    assert (v.action, v.reason) == (Action.ESCALATE, reason)


def test_agreement_checks_without_a_number_escalate_and_without_a_tier_continue() -> None:
    for verifier in (ProgramOfThought(), Resample()):
        tier = FakeTier()
        assert check(verifier, QUESTION, "I do not know.", ask=tier).action is Action.ESCALATE
        assert tier.asked == []  # no number: nothing to compare, nothing asked
        alone = check(verifier, QUESTION, "The answer is 7.")
        assert alone.action is Action.CONTINUE and alone.reason.endswith("no tier to ask")
        down = check(verifier, QUESTION, "The answer is 7.", ask=FakeTier(fail=True))
        assert down.action is Action.CONTINUE and "could not ask: the tier is down" in down.reason


def test_resample_asks_for_a_sampled_second_answer() -> None:
    tier = FakeTier("3 + 4 = 7, so 7.", "He has 7.")
    assert check(Resample(), QUESTION, "The answer is 7.", ask=tier).action is Action.CONTINUE
    wrong = check(Resample(), QUESTION, "The answer is 12.", ask=tier)
    assert (wrong.action, wrong.reason) == (Action.ESCALATE, "a second sample says 7, the answer 12")
    assert tier.asked[0] == ([{"role": "user", "content": QUESTION}], 512, 0.7)


def test_numbers_agree_within_rounding() -> None:
    assert agree("7", "7") and agree("7", "7.0000000001") and agree("3.33", "3.3333333")
    assert not agree("7", "8") and not agree("3.3", "3.36") and not agree("1000000", "1000001")


# --- wiring: policy names, the hook hands the tier to the checks ------------------------------------------


def test_policies_name_the_new_checks_and_the_hook_passes_ask_to_them() -> None:
    settings = VerifierSettings(checks=["prompt_examples", "program_of_thought", "resample"])
    _, final = build_verifiers(settings, 1)
    assert final is not None and final.name == "any(prompt_examples,program_of_thought,resample)"
    _, pot = build_verifiers(VerifierSettings(checks=["program_of_thought"]), 1)
    hook = VerifierHook(None, Context(prompt=QUESTION), ["r0"], pot)
    hook.traces["r0"] = answered("So 3 + 4 = 8. The answer is 8.")
    hook.run_checks(FakeTier(PROGRAM))
    assert hook.failed and hook.summary()[0]["reason"] == "the program prints 7, the answer 8"
    unasked = VerifierHook(None, Context(prompt=QUESTION), ["r0"], pot)
    unasked.traces["r0"] = answered("The answer is 8.")
    unasked.run_checks()
    assert not unasked.failed  # without a tier there is no second opinion


def test_tier_ask_generates_on_a_real_engine_from_another_thread(tmp_path: Path) -> None:
    """`tier_ask` through a blocking portal, as the benchmark uses it (the gateway's worker threads need none):
    a greedy reply, the tokens it spent, and `AskFailed` for a question longer than the context."""
    import anyio.from_thread

    from engines.async_engine import AsyncEngine
    from engines.engine import Engine, EngineConfig
    from tiny import tiny_hf_model
    from verifiers.ask import tier_ask

    model = tiny_hf_model("llama", tmp_path / "tiny")
    config = json.loads((model / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the words, as they are
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    engine = AsyncEngine(
        Engine.from_dir(model, dtype="fp32", config=EngineConfig(kv_cache_bytes=1 << 22, block_size=8))
    )
    engine.start()
    spent: list[tuple[int, int]] = []
    try:
        with anyio.from_thread.start_blocking_portal() as portal:
            ask = tier_ask(engine, portal=portal, spent=lambda p, c: spent.append((p, c)))
            messages = [{"role": "user", "content": "w5 w6 w7"}]
            first, again = ask(messages, 6), ask(messages, 6)
            assert first == again and spent[0] == spent[1] and 1 <= spent[0][1] <= 6
            with pytest.raises(AskFailed):
                ask([{"role": "user", "content": " ".join(["w9"] * 300)}], 6)
    finally:
        engine.shutdown()
