"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, penalties, seeds.

The sampler works on a batch of rows, each with its own parameters and random generator, so one
engine step can sample for many requests at once.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be 0 (off) or positive")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SamplingState:
    """Per-request sampler state: parameters, the request's own generator, and its output so far."""

    params: SamplingParams
    generator: torch.Generator = field(init=False)
    output_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    """One token per row of `logits` (rows, vocab), float32.

    Plain greedy rows share one batched argmax; rows with penalties or randomness go one by one,
    each with its own generator, so a seeded request samples the same tokens in any batch.
    """
    out = logits.argmax(-1).tolist()
    for i, (row, state) in enumerate(zip(logits, states, strict=True)):
        p = state.params
        if p.presence_penalty or p.frequency_penalty:
            row = _apply_penalties(row, state.output_ids, p)
            if p.greedy:
                out[i] = int(row.argmax())
        if p.greedy:
            continue
        out[i] = int(torch.multinomial(distribution(row, p), 1, generator=state.generator))
    return out


def distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature, then top-k, then top-p, on the
    last dimension of `logits` (float32, one row or many; top-p leaves it unnormalized). The speculative
    core uses it for both the target's and the draft's distributions, so acceptance reproduces exactly
    what this sampler draws."""
    row = logits / p.temperature
    if p.top_k and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[..., -1:]
        row = row.masked_fill(row < kth, float("-inf"))
    dist = torch.softmax(row, dim=-1)
    return _top_p(dist, p.top_p) if p.top_p < 1.0 else dist


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one)."""
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly ahead of each token
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _apply_penalties(row: torch.Tensor, output_ids: list[int], p: SamplingParams) -> torch.Tensor:
    if not output_ids:
        return row
    counts = torch.bincount(torch.tensor(output_ids), minlength=row.shape[-1])[: row.shape[-1]].to(row.dtype)
    return row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
