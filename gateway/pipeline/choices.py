"""What a run hands around: a choice's text delta (`ChoiceDelta`), and a tier that may serve a request
(`Candidate`). A leaf: the plan, single flight and the run all read them."""

from __future__ import annotations

from dataclasses import dataclass

from engines.protocol import TierEngine
from engines.request import TokenLogprob

__all__ = ["Candidate", "ChoiceDelta"]


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    text: str
    finish_reason: str | None  # set on a choice's last delta
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens generated since the last delta, when asked for


@dataclass(frozen=True)
class Candidate:
    """A tier that may serve a request: the requested one, or a fallback."""

    name: str
    engine: TierEngine
    checkpoint: str  # the model behind the tier, for the ledger
