"""The speculative core's arithmetic: lossless acceptance of drafted tokens, and how many to draft.

Acceptance (Leviathan et al. 2023, Chen et al. 2023). The target scores the last token and k drafts
in one forward, giving k+1 distributions p_0..p_k; the proposer drew draft j from q_j. Draft j is kept
with probability min(1, p_j(x)/q_j(x)); the first one refused is replaced by a sample from
norm(max(0, p_j − q_j)); if all k are kept, a bonus token comes from p_k. Every emitted token is then
distributed exactly as the target's own sampler would draw it. Greedy requests keep drafts while they
equal the target's argmax, which makes the output token-for-token plain greedy decoding. A proposer
without distributions (n-gram lookup) is a point mass q_j = δ(x): keep with probability p_j(x),
otherwise resample from p_j without x. p and q are `engines.sampling.distribution` of each model's
logits, so temperature, top-k and top-p shape both sides, and the request's own generator draws.

How many (adaptive k). With a per-token acceptance rate α a verification of k drafts emits
(1 − α^{k+1}) / (1 − α) tokens on average. Its cost over a plain step is k verified rows plus k draft
rows, each priced from linear fits of measured forward times (seconds = fixed + per-token × tokens).
Each request takes the k that maximises tokens per second, 0 when drafting does not pay (at large
batches the rows are no longer free); a request at 0 tries k = 1 now and then so α stays current.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.sampling import SamplingParams, SamplingState, distribution, draw


def accept(
    target_logits: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    state: SamplingState,
) -> list[int]:
    """The tokens to append: the kept prefix of `draft_tokens`, then one correction or bonus token.

    `target_logits` (k+1, vocab) float32; `draft_probs` (k, vocab) the draft's distributions, or None
    for a point-mass proposer."""
    k = len(draft_tokens)
    p = state.params
    if p.greedy:
        best = target_logits.argmax(-1).tolist()
        for j, token in enumerate(draft_tokens):
            if best[j] != token:
                return [*draft_tokens[:j], best[j]]
        return [*draft_tokens, best[k]]
    target = _normalized(distribution(target_logits, p))
    draft = None if draft_probs is None else _normalized(draft_probs)
    u = torch.rand(k, generator=state.generator, dtype=torch.float64).tolist() if k else []
    for j, token in enumerate(draft_tokens):
        pj = target[j]
        qx = 1.0 if draft is None else float(draft[j, token])
        if u[j] * qx < float(pj[token]):  # u < p/q without dividing by a zero q
            continue
        if draft is None:
            residual = pj.clone()
            residual[token] = 0.0
        else:
            residual = (pj - draft[j]).clamp_min_(0.0)
        if float(residual.sum()) <= 0.0:  # p ≤ q everywhere only by rounding: p itself is the answer
            residual = pj
        return [*draft_tokens[:j], draw(residual, state.generator)]
    return [*draft_tokens, draw(target[k], state.generator)]


def _normalized(dist: torch.Tensor) -> torch.Tensor:
    return dist.double() / dist.double().sum(-1, keepdim=True)


def draft_token(logits: torch.Tensor, state: SamplingState) -> tuple[int, torch.Tensor | None]:
    """A draft model's proposal from one row of its logits: argmax for greedy requests, else a sample
    from its distribution under the request's parameters (returned, as acceptance needs it)."""
    if state.params.greedy:
        return int(logits.argmax()), None
    q = distribution(logits, state.params)
    return draw(q, state.generator), q


def speculates(params: SamplingParams) -> bool:
    """Penalties make each position's distribution depend on the tokens before it in ways the verifying
    forward does not see, and a logit bias is not in the distributions acceptance compares, so such
    requests decode plainly."""
    return not (params.presence_penalty or params.frequency_penalty or params.logit_bias)


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens one verification of k drafts emits at per-token acceptance rate `alpha`."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class LinearCost:
    """seconds ≈ fixed + per_token × tokens, fitted online with exponential forgetting."""

    def __init__(self, per_token_share: float, decay: float = 0.97) -> None:
        self.decay = decay
        self.prior_share = per_token_share  # per_token / fixed until the data pins the slope
        self._s = [0.0] * 5  # Σw, Σw·n, Σw·t, Σw·n², Σw·n·t

    def add(self, tokens: int, seconds: float) -> None:
        w, n, t = 1.0, float(tokens), seconds
        self._s = [s * self.decay + x for s, x in zip(self._s, (w, w * n, w * t, w * n * n, w * n * t), strict=True)]

    @property
    def known(self) -> bool:
        return self._s[0] > 0

    def coefficients(self) -> tuple[float, float]:
        sw, sn, st, snn, snt = self._s
        if sw == 0:
            return 0.0, 0.0
        mean_n, mean_t = sn / sw, st / sw
        var = snn / sw - mean_n**2
        if var > 0.25:  # the batch sizes seen vary enough to fit a slope
            slope = max(0.0, (snt / sw - mean_n * mean_t) / var)
            return max(0.0, mean_t - slope * mean_n), slope
        fixed = mean_t / (1.0 + self.prior_share * mean_n)
        return fixed, fixed * self.prior_share

    def predict(self, tokens: float) -> float:
        fixed, per_token = self.coefficients()
        return fixed + per_token * tokens


@dataclass
class Acceptance:
    """Per-token acceptance, counted as kept drafts over kept drafts plus refusals."""

    kept: float = 0.0
    trials: float = 0.0
    idle_steps: int = 0  # steps in a row at k = 0
    probe_after: int = 16  # idle steps before the next probe (doubles while probes fail)

    def update(self, proposed: int, kept: int) -> None:
        self.kept += kept
        self.trials += kept + (1 if kept < proposed else 0)

    def rate(self, prior: float, weight: float = 4.0) -> float:
        return (self.kept + prior * weight) / (self.trials + weight)


@dataclass
class SpecStats:
    """What the proposer offered and the target kept, over the engine's life."""

    steps: int = 0  # verifications (one per speculating sequence per step)
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens appended by verifications: kept drafts plus one each
    draft_seconds: float = 0.0
    by_k: dict[int, int] = field(default_factory=dict)  # how often each k was chosen

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Drafts kept per verification."""
        return self.accepted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "spec_steps": self.steps,
            "spec_proposed": self.proposed,
            "spec_accepted": self.accepted,
            "spec_acceptance_rate": round(self.acceptance_rate, 4),
            "spec_mean_accepted_length": round(self.mean_accepted_length, 4),
            "spec_tokens_per_verification": round(self.emitted / self.steps, 4) if self.steps else 0.0,
        }


def choose_k(
    alpha: float,
    k_max: int,
    base_cost: float,
    row_cost: float,
    draft_row_cost: float,
    probe: bool,
    setup_cost: float = 0.0,
    min_gain: float = 0.0,
) -> int:
    """The k in 0..k_max with the most tokens per second for one sequence: a plain step costs
    `base_cost` (its share of the batch), each draft adds a verified row and a drafted row, and
    drafting at all adds `setup_cost` (a draft that must first catch up on tokens it skipped).
    A k > 0 must beat the plain rate by `min_gain` (a fraction): the costs price the forwards only."""
    best_k, best = 0, (1.0 + min_gain) / base_cost if base_cost > 0 else 0.0
    for k in range(1, k_max + 1):
        rate = expected_tokens(alpha, k) / (base_cost + k * (row_cost + draft_row_cost) + setup_cost)
        if rate > best * 1.0001:
            best_k, best = k, rate
    return max(best_k, 1 if probe and k_max else 0)
