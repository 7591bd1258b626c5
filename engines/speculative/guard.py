"""Speculation never costs speed: adaptive k's cost model, checked against measured step rates.

Adaptive k (`engines.speculative.acceptance.choose_k`) prices the forwards it times, not the rest of a
step (the draft's bookkeeping, acceptance, rollback), and its fits drift with the load, so on its own it
drafted at batch 8 where that ran 0.94-0.95x plain (AMD EPYC, AVX-512 VNNI kernels). The guard keeps,
per batch size (sequences in a pure decode step, in power-of-two buckets), the measured tokens per
second of whole plain steps and of whole drafting steps. Where drafting runs slower, that batch size
decodes plainly but for one drafting step in `EXPLORE_EVERY`; elsewhere one plain step in
`EXPLORE_EVERY` keeps the plain rate current (the cost of the check: 1/16 of the steps at plain speed).
"""

from __future__ import annotations

from dataclasses import dataclass

EXPLORE_EVERY = 16
NEW_WEIGHT = 0.25  # a new step's share of a rate (exponential average): steps vary with the batch's contexts


@dataclass
class _Rates:
    plain: float = 0.0  # tokens per second of plain decode steps
    drafting: float = 0.0  # tokens per second of decode steps that verified drafts
    steps: int = 0


def _average(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - NEW_WEIGHT) * old + NEW_WEIGHT * new


class SpeedGuard:
    def __init__(self) -> None:
        self._rates: dict[int, _Rates] = {}

    @staticmethod
    def _bucket(num_seqs: int) -> int:
        return num_seqs.bit_length()

    def allow(self, num_seqs: int) -> bool:
        """Whether a pure decode step of `num_seqs` sequences may draft (counts the step)."""
        r = self._rates.setdefault(self._bucket(num_seqs), _Rates())
        r.steps += 1
        if r.plain == 0.0:
            return False  # measure plain decoding first
        if r.drafting and r.drafting < r.plain:
            return r.steps % EXPLORE_EVERY == 0  # slower: draft now and then, in case that changed
        return r.steps % EXPLORE_EVERY != 0

    def observe(self, num_seqs: int, tokens: int, seconds: float, drafted: bool) -> None:
        """A whole pure decode step: `tokens` appended across its sequences in `seconds`."""
        if seconds <= 0:
            return
        r = self._rates.setdefault(self._bucket(num_seqs), _Rates())
        if drafted:
            r.drafting = _average(r.drafting, tokens / seconds)
        else:
            r.plain = _average(r.plain, tokens / seconds)

    def rates(self) -> dict[int, tuple[float, float]]:
        """Bucket → (plain, drafting) tokens/s; bucket b holds batches of 2^(b-1) .. 2^b - 1 sequences."""
        return {b: (r.plain, r.drafting) for b, r in sorted(self._rates.items())}
