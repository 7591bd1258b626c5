"""Labeled answers with a learnable signal, shared by the probe's tests and the cascade's."""

from __future__ import annotations


def apple_answers() -> tuple[list[tuple[str, str]], list[bool]]:
    """A learnable signal: right answers reason and end in a number; wrong ones trail off or repeat."""
    questions = [f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?" for i in range(40)]
    right = [
        f"He starts with {i} and buys {i + 3}, so {i} + {i + 3} = {2 * i + 3}. The answer is {2 * i + 3}."
        for i in range(40)
    ]
    wrong = [
        "I am not sure what you mean by apples, apples, apples." if i % 2 else "Let me think about it"
        for i in range(40)
    ]
    pairs = [*zip(questions, right, strict=True), *zip(questions, wrong, strict=True)]
    return pairs, [True] * 40 + [False] * 40
