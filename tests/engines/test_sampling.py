"""The sampler: greedy, temperature, top-k, top-p, penalties and seeds."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engines import sampling
from engines.sampling import CANDIDATES, SamplingParams, SamplingState, distribution, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def draw(params: SamplingParams, n: int, logits: torch.Tensor = LOGITS) -> Counter:
    state = SamplingState(params)
    return Counter(sample(logits, [state])[0] for _ in range(n))


def test_greedy_takes_the_argmax() -> None:
    assert draw(SamplingParams(temperature=0.0), 20) == Counter({0: 20})


def test_temperature_one_follows_softmax() -> None:
    counts = draw(SamplingParams(temperature=1.0, seed=0), 20000)
    probs = torch.softmax(LOGITS[0], -1)
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / 20000 - p) < 0.015


def test_top_k_keeps_only_the_k_best() -> None:
    counts = draw(SamplingParams(temperature=1.5, top_k=2, seed=1), 3000)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 3000 - torch.softmax(LOGITS[0, :2] / 1.5, -1)[0].item()) < 0.03


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.softmax(LOGITS[0], -1).tolist()  # ~0.57, 0.21, 0.13, 0.08, ...
    counts = draw(SamplingParams(top_p=probs[0] + probs[1] - 1e-3, seed=2), 3000)
    assert set(counts) == {0, 1}
    assert draw(SamplingParams(top_p=0.01, seed=3), 200) == Counter({0: 200})  # always at least one


def full_sort_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: sort the whole vocabulary, keep the smallest prefix whose mass reaches top_p."""
    probs = torch.softmax(logits, -1)
    ordered, order = probs.sort(descending=True)
    kept = ordered.masked_fill(ordered.cumsum(-1) - ordered >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, kept)


@pytest.mark.parametrize("scale", [8.0, 0.05])  # peaked (nucleus of a few tokens); flat (wider than CANDIDATES)
def test_top_p_over_a_large_vocabulary_matches_sorting_all_of_it(scale: float) -> None:
    logits = torch.randn(3, 50_000, generator=torch.Generator().manual_seed(0)) * scale
    got = distribution(logits, SamplingParams(top_p=0.9))
    assert torch.allclose(got, full_sort_top_p(logits, 0.9), atol=1e-7)
    kept = int((got[0] > 0).sum())
    assert (kept < CANDIDATES) if scale > 1 else (kept > CANDIDATES)  # both paths were taken


def test_draw_follows_the_weights_and_never_picks_a_zero() -> None:
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.0])
    gen = torch.Generator().manual_seed(4)
    counts = Counter(sampling.draw(weights, gen) for _ in range(8000))
    assert set(counts) == {1, 3}
    assert abs(counts[1] / 8000 - 0.75) < 0.02


def test_seed_makes_sampling_reproducible() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    a, b, c = (SamplingState(SamplingParams(seed=s)) for s in (7, 7, 8))
    seq_a = [sample(logits, [a])[0] for _ in range(50)]
    assert seq_a == [sample(logits, [b])[0] for _ in range(50)]
    assert seq_a != [sample(logits, [c])[0] for _ in range(50)]


def test_batch_rows_use_their_own_parameters() -> None:
    logits = LOGITS.repeat(2, 1)
    states = [SamplingState(SamplingParams(temperature=0.0)), SamplingState(SamplingParams(top_k=1, seed=1))]
    assert sample(logits, states) == [0, 0]


def test_penalties_push_repeated_tokens_down() -> None:
    state = SamplingState(SamplingParams(temperature=0.0, frequency_penalty=2.0))
    state.output_ids.extend([0, 0])  # token 0 already said twice: 2.0 - 2*2.0 < 1.0
    assert sample(LOGITS, [state]) == [1]
    state = SamplingState(SamplingParams(temperature=0.0, presence_penalty=-2.0))
    state.output_ids.append(2)  # a negative presence penalty favours what was said
    assert sample(LOGITS, [state]) == [2]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"temperature": 2.5},
        {"top_p": 0.0},
        {"top_k": -1},
        {"presence_penalty": 3.0},
        {"stop": ("",)},
    ],
)
def test_invalid_parameters_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
