"""Speculative decoding inside continuous batching: which decodes draft how many tokens, and what the
target's verification keeps.

Each engine step, after the scheduler has picked the batch, every sequence that is decoding (one
token to compute) and speculates (`engines.speculative.acceptance.speculates`) gets a k from its own running
acceptance rate and the measured step costs; the target's blocks for its k extra positions are taken
(no k where the pool has none to spare: speculation never preempts anyone). The proposer drafts, the
target computes the last token and the drafts as one chunk with logits on every row, and `accept`
decides. Rejected positions roll back: `num_computed` stops after the kept tokens and the blocks past
them go back to the pool, in the target and the draft alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engines.block_manager import BlockManager
from engines.scheduler import ScheduledBatch
from engines.sequence import Sequence
from engines.speculative.acceptance import Acceptance, LinearCost, SpecStats, choose_k, speculates
from engines.speculative.guard import SpeedGuard
from engines.speculative.proposers import Draft, DraftProposer, NgramProposer

if TYPE_CHECKING:
    from engines.kv.budget import KVBudget
    from engines.models.llama import LlamaForCausalLM
    from engines.tokenizer import Tokenizer

AMORTIZE_STEPS = 16  # steps over which a draft's catch-up on skipped tokens is expected to pay back
BOOTSTRAP_TRIALS = 32  # drafts verified before the measured acceptance alone sets a new request's prior
PROBE_EVERY = 16  # a request whose k fell to 0 tries one draft after this many steps, then twice as
# many after each probe that does not bring k back, so its rate stays current at little cost


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"  # "off" | "ngram" | "draft"
    num_speculative_tokens: int = 4  # the most drafts per sequence per step (k_max)
    adaptive: bool = True  # False: always k_max (benchmarks, tests)
    ngram_max: int = 4
    ngram_min: int = 2
    draft_kv_cache_bytes: int = 256 << 20
    draft_vocab: int = 0  # > 0: the draft proposes only the first this many ids and special tokens
    prior_acceptance: float = 0.6  # a new request's acceptance rate before it has any
    # Adaptive k drafts only where the predicted tokens/s beat plain decoding by this fraction. Off by
    # default: the measured guard (guard.py) catches what the cost fits miss, while a margin at the
    # prior acceptance kept the 0.5B draft from ever drafting at batch 1 (its best k predicted +5%, so
    # no acceptance was ever measured). AMD EPYC, AVX-512 VNNI kernels.
    min_gain: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in ("off", "ngram", "draft"):
            raise ValueError(f"speculative method must be off, ngram or draft, not {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: NgramProposer | DraftProposer) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = SpecStats()
        self.target_cost = LinearCost(per_token_share=0.2)
        self.draft_cost = LinearCost(per_token_share=0.2)
        self._acceptance: dict[str, Acceptance] = {}
        self._global = Acceptance()
        self.guard = SpeedGuard()
        self._catching_up = False  # this step's draft first computes tokens it skipped (not a typical step)
        self._catchup_per_token = 0.0  # seconds per token of a draft's prompt computation or catch-up

    def propose(self, batch: ScheduledBatch, bm: BlockManager, max_model_len: int, budget: int) -> dict[int, Draft]:
        """Drafts for the batch's decoding sequences, by batch index; takes the target blocks they need.
        `budget`: the most extra tokens this step may carry."""
        eligible = [
            i
            for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new, strict=True))
            if n == 1
            and seq.num_uncomputed == 1
            and speculates(seq.request.params)
            and seq.constraint is None
            and seq.request.hidden_layer is None
        ]
        if not eligible:
            return {}
        self._catching_up = False
        pure = len(eligible) == len(batch.seqs) > 1  # batch 1 is left to adaptive k (see guard.py)
        if self.config.adaptive and pure and not self.guard.allow(len(batch.seqs)):
            return {}  # a pure decode step of a batch size where drafting measured slower (guard.py)
        prior = self._prior()
        costs = self._costs(len(batch.seqs), batch.num_tokens, len(eligible))
        seqs, ks = [], []
        for i in eligible:
            seq = batch.seqs[i]
            left = min(seq.request.params.max_tokens - seq.num_generated, max_model_len - len(seq.token_ids)) - 1
            k_max = max(0, min(self.config.num_speculative_tokens, left, budget))
            acc = self._acceptance.setdefault(seq.request_id, Acceptance())
            lag = self.proposer.lag(seq)
            if self.config.adaptive:
                # A draft that skipped tokens computes them before it drafts: a cost spread over the
                # steps it then saves, and a reason not to probe (cheap probes only).
                setup = lag * self._catchup_per_token / AMORTIZE_STEPS
                merit = (
                    choose_k(
                        acc.rate(prior), k_max, *costs, probe=False, setup_cost=setup, min_gain=self.config.min_gain
                    )
                    if costs
                    else 0
                )
                probe = not merit and k_max > 0 and lag <= k_max + 2 and acc.idle_steps >= acc.probe_after
                k = merit or int(probe)
                acc.idle_steps = 0 if k else acc.idle_steps + 1
                if merit:
                    acc.probe_after = PROBE_EVERY
                elif probe:
                    acc.probe_after *= 2
            else:
                k = k_max
            need = bm.blocks_needed(seq.block_table, seq.num_computed + 1 + k)
            if k and lag > 2:  # a one-off cost, priced by setup_cost, not by the guard
                self._catching_up = True
            if k and bm.can_allocate(need, optional=True):
                bm.allocate(seq.block_table, need)
                seqs.append(i)
                ks.append(k)
                budget -= k
        if not seqs:
            return {}
        drafts = self.proposer.propose([batch.seqs[i] for i in seqs], ks)
        self._drain_rounds()
        for i, draft in zip(seqs, drafts, strict=True):  # fewer drafts than asked: give back the blocks
            seq = batch.seqs[i]
            bm.truncate(seq.block_table, seq.num_computed + 1 + len(draft.tokens))
        return {i: d for i, d in zip(seqs, drafts, strict=True) if d.tokens}

    def prefilled(self, batch: ScheduledBatch) -> None:
        """After a step, the batch's sequences that just got their first token: a draft model computes
        their prompts now, in the prefill step, for those expected to speculate at this load."""
        seqs = [seq for seq in batch.seqs if seq.num_generated == 1 and seq.finish_reason is None]
        if not seqs or not isinstance(self.proposer, DraftProposer):
            return
        batch_size = len(batch.seqs)
        costs = self._costs(batch_size, batch_size, max(1, len(seqs)))  # as the decode steps to come
        prior = self._prior()
        k = self.config.num_speculative_tokens
        if not self.config.adaptive or (
            costs and choose_k(prior, k, *costs, probe=False, min_gain=self.config.min_gain)
        ):
            self.proposer.prefill(seqs)
            self._drain_rounds()

    def observe_step(self, batch: ScheduledBatch, tokens: int, seconds: float, drafted: bool) -> None:
        """A whole step (drafting, forward, acceptance, bookkeeping) that appended `tokens`: pure decode
        steps feed the guard."""
        if len(batch.seqs) > 1 and all(n == 1 for n in batch.num_new) and not (drafted and self._catching_up):
            self.guard.observe(len(batch.seqs), tokens, seconds, drafted)

    def _prior(self) -> float:
        """A new request's acceptance rate before it has any: the recent traffic's, but not below the
        configured prior until BOOTSTRAP_TRIALS drafts are verified. A few unlucky first drafts must not
        stop speculation for good: a draft that stops drafting falls behind, and a lagging draft is
        never probed (measured: one rejected warm-up draft did that to the 0.5B draft)."""
        prior = self._global.rate(self.config.prior_acceptance)
        if self._global.trials < BOOTSTRAP_TRIALS:
            prior = max(prior, self.config.prior_acceptance)
        return prior

    def record_step(self, tokens: int, seconds: float) -> None:
        """The target forward's size and time, for the cost fit."""
        self.target_cost.add(tokens, seconds)

    def verified(self, seq: Sequence, proposed: int, kept: int, emitted: int) -> None:
        """A verification of `proposed` drafts kept `kept` of them and appended `emitted` tokens (fewer where
        the sequence finished on the way); the request is billed for what it saw."""
        acc = self._acceptance.setdefault(seq.request_id, Acceptance())
        acc.update(proposed, kept)
        self._global.update(proposed, kept)
        self._global.kept *= 0.999  # the global prior follows the recent traffic
        self._global.trials *= 0.999
        s = self.stats
        s.steps += 1
        s.proposed += proposed
        s.accepted += kept
        s.emitted += emitted
        s.by_k[proposed] = s.by_k.get(proposed, 0) + 1
        self.proposer.rollback(seq)
        seq.draft_proposed += proposed
        seq.draft_accepted += min(kept, emitted)  # billed: never past the end

    def release(self, seq: Sequence) -> None:
        self._acceptance.pop(seq.request_id, None)
        self.proposer.release(seq)

    def _drain_rounds(self) -> None:
        if isinstance(self.proposer, DraftProposer):
            for tokens, seconds in self.proposer.rounds:
                self.draft_cost.add(tokens, seconds)
                self.stats.draft_seconds += seconds
            for tokens, seconds in self.proposer.prefills:
                rate = seconds / tokens
                self._catchup_per_token = (
                    rate if not self._catchup_per_token else 0.8 * self._catchup_per_token + 0.2 * rate
                )
                self.stats.draft_seconds += seconds
            self.proposer.rounds.clear()
            self.proposer.prefills.clear()

    def _costs(self, num_seqs: int, num_tokens: int, num_spec: int) -> tuple[float, float, float] | None:
        """(a plain step's cost per sequence, one more verified row, one drafted row) in seconds;
        None until a target step has been timed (no speculation on guesses)."""
        if not self.target_cost.known:
            return None
        fixed, per_token = self.target_cost.coefficients()
        base = (fixed + per_token * num_tokens) / num_seqs
        if isinstance(self.proposer, NgramProposer):
            return base, per_token, 0.0
        if not self.draft_cost.known:  # about what a 0.5B draft costs next to a 1.5B target
            return base, per_token, 0.35 * base
        d_fixed, d_per_token = self.draft_cost.coefficients()
        return base, per_token, d_fixed / num_spec + d_per_token


def build_speculator(
    spec: SpeculativeConfig,
    target: LlamaForCausalLM,
    draft_model: LlamaForCausalLM | None,
    tokenizer: Tokenizer,
    *,
    block_size: int,
    salt: str,
    budget: KVBudget | None,
) -> Speculator | None:
    """An engine's speculator for `spec`, None when it is off. `draft_model`: the proposer for method
    "draft" (same tokenizer as the target); its KV pool draws on `budget` and hashes under `salt`."""
    if spec.method == "off":
        return None
    if spec.method == "ngram":
        return Speculator(spec, NgramProposer(spec.ngram_max, spec.ngram_min))
    if draft_model is None:
        raise ValueError('speculative method "draft" needs a draft model')
    if draft_model.config.vocab_size > target.config.vocab_size:
        raise ValueError("the draft model's vocabulary is larger than the target's")
    proposer = DraftProposer(draft_model, spec.draft_kv_cache_bytes, block_size, salt=f"draft|{salt}", budget=budget)
    if spec.draft_vocab:
        from engines.speculative.draft_head import frequent_token_ids

        vocab = draft_model.config.vocab_size
        proposer.runner.restrict_vocab(frequent_token_ids(tokenizer, vocab, spec.draft_vocab))
    return Speculator(spec, proposer)
