"""Degeneration: a generation caught in a loop, or a list that will not end, is stopped early.

- Loops: the last tokens repeat with some period p (1 to `max_period` tokens), for at least `min_repeats`
  periods and `min_tokens` tokens: "the the the", or a sentence or a whole paragraph said again and again.
  Small models under greedy decoding fall into these and run to `max_tokens`, all of it billed.
- Runaway lists: more than `max_items` list items (lines starting with "-", "*", "•" or a number), or
  one line repeated `max_same_lines` times.

The verdict is `stop`: the answer so far is kept (the repetition was already streamed) and nothing more
is generated. The score is 1 minus the share of the trace that the loop covers.
"""

from __future__ import annotations

import re

from verifiers.base import Action, Context, Trace, TraceVerifier, Verdict

_ITEM = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+\S")


def repeating_tail(tokens: list[int], max_period: int) -> tuple[int, int]:
    """(period, length) of the longest periodic tail: the last `length` tokens each equal the token
    `period` places before; the shortest period among equally long tails. (0, 0) if none."""
    best = (0, 0)
    n = len(tokens)
    for p in range(1, min(max_period, n // 2) + 1):
        run = 0
        while run < n - p and tokens[n - 1 - run] == tokens[n - 1 - run - p]:
            run += 1
        if run and run + p > best[1] + best[0]:  # the periodic stretch includes the first period itself
            best = (p, run)
    period, run = best
    return (period, run + period) if period else (0, 0)


class Degeneration(TraceVerifier):
    name = "degeneration"

    def __init__(
        self,
        *,
        every: int = 16,
        max_period: int = 64,
        min_repeats: int = 4,
        min_tokens: int = 32,
        max_items: int = 60,
        max_same_lines: int = 6,
    ) -> None:
        self.every = every
        self.max_period = max_period
        self.min_repeats = min_repeats
        self.min_tokens = min_tokens
        self.max_items = max_items
        self.max_same_lines = max_same_lines

    def check_trace(self, context: Context, trace: Trace) -> Verdict:
        tokens = trace.token_ids
        # only the tail matters, and scanning it is O(max_period × tail): bound it
        tail = tokens[-(self.max_period * (self.min_repeats + 2)) :]
        period, length = repeating_tail(tail, self.max_period)
        if period and length >= max(self.min_tokens, self.min_repeats * period):
            score = 1.0 - length / max(len(tokens), 1)
            reason = f"the last {length} tokens repeat every {period} tokens ({length / period:.1f} times)"
            return self.verdict(Action.STOP, score, reason)
        lines = [line.strip() for line in trace.text.splitlines() if line.strip()]
        items = sum(1 for line in lines if _ITEM.match(line))
        if items > self.max_items:
            return self.verdict(Action.STOP, 0.5, f"a list of {items} items (more than {self.max_items})")
        if lines:
            most = max(lines.count(line) for line in set(lines[-self.max_same_lines * 2 :]))
            if most >= self.max_same_lines:
                return self.verdict(Action.STOP, 0.5, f"one line said {most} times")
        return self.verdict(Action.CONTINUE, 1.0, "")
