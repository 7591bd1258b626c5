"""Speculation never costs speed: adaptive k's cost model, checked against measured step rates.

Adaptive k (`engines.speculative.acceptance.choose_k`) prices the forwards it times, not the rest of a
step (the draft's bookkeeping, acceptance, rollback), and its fits drift with the load, so on its own it
drafted at batch 8 where that ran 0.94-0.95x plain (AMD EPYC, AVX-512 VNNI kernels). The guard keeps,
per batch size (sequences in a pure decode step, in power-of-two buckets), the measured tokens per
second of whole plain steps and of whole drafting steps (averaged tokens over averaged seconds). Once
each kind has `MIN_SAMPLES` steps, a batch size where drafting runs slower decodes plainly but for a
check now and then; elsewhere one plain step in `EXPLORE_EVERY` keeps the plain rate current (the
check's cost: 1/16 of the steps at plain speed, 1/4 until plain is measured).

A check where drafting is off is two drafting steps: a draft model that sat out has tokens to catch up
on first, and a catch-up step is not a typical one (the speculator leaves it unmeasured), so only the
second step measures. Each check that still finds drafting slower doubles the wait before the next
(from `EXPLORE_EVERY` up to `MAX_EXPLORE_EVERY` steps). Before, a check was one drafting step in 16:
always a catch-up, so never measured, it cost a 0.5B draft's catch-up on 16 tokens per sequence and
could not find drafting faster again (0.91x plain at batch 8 on an AVX-512 VNNI EPYC).

Batches of one sequence are left to adaptive k alone: there each request's steps alternate between
catching its draft up, drafting and idling at k = 0, and the whole-step rates measured too noisy to
judge by (the guard turned a draft off at batch 1 that measured 1.2-1.7x plain in the benchmark).
"""

from __future__ import annotations

from dataclasses import dataclass

EXPLORE_EVERY = 16
MAX_EXPLORE_EVERY = 256  # the longest wait between checks of a batch size where drafting measured slower
CHECK_STEPS = 2  # drafting steps per check: the first catches a lagging draft up, the second is measured
NEW_WEIGHT = 0.25  # a new step's share of the averages: steps vary with the batch's contexts
MIN_SAMPLES = 4  # steps of each kind before the guard judges: a draft's first step catches up on the prompt


@dataclass
class _Rates:
    plain: tuple[float, float] = (0.0, 0.0)  # averaged (tokens, seconds) of plain decode steps
    drafting: tuple[float, float] = (0.0, 0.0)  # of decode steps that verified drafts
    plain_steps: int = 0
    drafting_steps: int = 0
    steps: int = 0
    explore_every: int = EXPLORE_EVERY  # steps between checks while drafting measures slower
    next_check: int = 0  # the step at which the next check starts (0: when drafting first measures slower)
    checking: int = 0  # drafting steps left in the current check

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
        step until plain is measured; then, where drafting measured slower, a check of `CHECK_STEPS`
        drafting steps after a wait that doubles each time, elsewhere plain every 16th step."""
        r = self._rates.setdefault(self._bucket(num_seqs), _Rates())
        r.steps += 1
        if r.plain_steps < MIN_SAMPLES:
            return r.steps % 4 != 0
        slower = r.drafting_steps >= MIN_SAMPLES and r.rate(r.drafting) < r.rate(r.plain)
        if not slower:
            r.explore_every, r.next_check, r.checking = EXPLORE_EVERY, 0, 0
            return r.steps % EXPLORE_EVERY != 0
        if r.checking:
            r.checking -= 1
            return True
        if not r.next_check:  # just measured slower: the first check comes after the shortest wait
            r.next_check = r.steps + r.explore_every
        elif r.steps >= r.next_check:  # a check, and a longer wait before the next while it stays slower
            r.explore_every = min(2 * r.explore_every, MAX_EXPLORE_EVERY)
            r.next_check, r.checking = r.steps + r.explore_every, CHECK_STEPS - 1
            return True
        return False

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
