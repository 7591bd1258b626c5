"""Speculation never costs speed: adaptive k's cost model, checked against measured step rates.

Adaptive k (`engines.speculative.acceptance.choose_k`) prices the forwards it times, not the rest of a
step (the draft's bookkeeping, acceptance, rollback), and its fits drift with the load, so on its own it
drafted at batch 8 where that ran 0.94-0.95x plain (AMD EPYC, AVX-512 VNNI kernels). The guard keeps,
per batch size (sequences in a pure decode step, in power-of-two buckets), the measured tokens per
second of whole plain steps and of whole drafting steps (averaged tokens over averaged seconds). Once
each kind has `MIN_SAMPLES` steps, a batch size where drafting runs slower decodes plainly but for one
drafting step in `EXPLORE_EVERY`; elsewhere one plain step in `EXPLORE_EVERY` keeps the plain rate
current (the check's cost: 1/16 of the steps at plain speed, 1/4 until plain is measured).

Batches of one sequence are left to adaptive k alone: there each request's steps alternate between
catching its draft up, drafting and idling at k = 0, and the whole-step rates measured too noisy to
judge by (the guard turned a draft off at batch 1 that measured 1.2-1.7x plain in the benchmark).
"""

from __future__ import annotations

from dataclasses import dataclass

EXPLORE_EVERY = 16
NEW_WEIGHT = 0.25  # a new step's share of the averages: steps vary with the batch's contexts
MIN_SAMPLES = 4  # steps of each kind before the guard judges: a draft's first step catches up on the prompt


@dataclass
class _Rates:
    plain: tuple[float, float] = (0.0, 0.0)  # averaged (tokens, seconds) of plain decode steps
    drafting: tuple[float, float] = (0.0, 0.0)  # of decode steps that verified drafts
    plain_steps: int = 0
    drafting_steps: int = 0
    steps: int = 0

    @staticmethod
    def rate(avg: tuple[float, float]) -> float:
        return avg[0] / avg[1] if avg[1] > 0 else 0.0


def _average(old: tuple[float, float], tokens: int, seconds: float) -> tuple[float, float]:
    if old[1] == 0.0:
        return float(tokens), seconds
    return (1 - NEW_WEIGHT) * old[0] + NEW_WEIGHT * tokens, (1 - NEW_WEIGHT) * old[1] + NEW_WEIGHT * seconds


class SpeedGuard:
    def __init__(self) -> None:
        self._rates: dict[int, _Rates] = {}

    @staticmethod
    def _bucket(num_seqs: int) -> int:
        return num_seqs.bit_length()

    def allow(self, num_seqs: int) -> bool:
        """Whether a pure decode step of `num_seqs` sequences may draft (counts the step). Drafting from
        the start (a plain first step would leave a draft model behind on the prompt), plain every 4th
        step until plain is measured, then every 16th."""
        r = self._rates.setdefault(self._bucket(num_seqs), _Rates())
        r.steps += 1
        if r.plain_steps < MIN_SAMPLES:
            return r.steps % 4 != 0
        slower = r.drafting_steps >= MIN_SAMPLES and r.rate(r.drafting) < r.rate(r.plain)
        if slower:
            return r.steps % EXPLORE_EVERY == 0  # draft now and then, in case that changed
        return r.steps % EXPLORE_EVERY != 0

    def observe(self, num_seqs: int, tokens: int, seconds: float, drafted: bool) -> None:
        """A whole pure decode step: `tokens` appended across its sequences in `seconds`."""
        if seconds <= 0:
            return
        r = self._rates.setdefault(self._bucket(num_seqs), _Rates())
        if drafted:
            r.drafting, r.drafting_steps = _average(r.drafting, tokens, seconds), r.drafting_steps + 1
        else:
            r.plain, r.plain_steps = _average(r.plain, tokens, seconds), r.plain_steps + 1

    def rates(self) -> dict[int, tuple[float, float]]:
        """Bucket → (plain, drafting) tokens/s; bucket b holds batches of 2^(b-1) .. 2^b - 1 sequences."""
        return {b: (r.rate(r.plain), r.rate(r.drafting)) for b, r in sorted(self._rates.items())}
