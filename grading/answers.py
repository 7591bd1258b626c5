"""Answers read from text: the final number of a math answer, GSM8K's reference, fenced code blocks.

A number is canonical when compared (commas stripped, `18.00` equals `18`); digits inside words do not
count; an unclosed fence (the answer ran out of tokens) runs to the end of the text.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["answer_code", "canonical_number", "extract_answer", "fenced_blocks", "reference_answer"]

_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")
_FENCE = re.compile(r"```([\w+.-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.S | re.M)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(tag, code) of each fenced block; an unclosed fence (the answer ran out of tokens) runs to the end."""
    return _FENCE.findall(text)


def canonical_number(text: str) -> str | None:
    """A number as a canonical decimal string ("1,000.50" → "1000.5", "18.00" → "18"); None if not one."""
    try:
        d = Decimal(text.replace(",", "").strip())
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The last number in a completion, canonical; None if it has none. Digits inside words do not count."""
    numbers = _NUMBER.findall(text)
    return canonical_number(numbers[-1]) if numbers else None


def reference_answer(answer: str) -> str | None:
    """GSM8K's reference: the number after `####`."""
    _, sep, tail = answer.rpartition("####")
    return canonical_number(tail) if sep else None


def answer_code(text: str) -> str:
    """The code of an answer: its fenced blocks joined, else the whole text."""
    blocks = [code for _, code in fenced_blocks(text)]
    return "\n\n".join(blocks) if blocks else text
