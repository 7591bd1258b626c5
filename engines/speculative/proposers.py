"""Proposers: where speculative drafts come from.

- `NgramProposer` (prompt lookup): the tokens that followed the latest earlier occurrence of the
  sequence's last n tokens. Free to compute and exact where the output copies its input (code edits,
  quoting, extraction); needs no draft model, so any single tier can use it.
- `DraftProposer`: a small model with the target's tokenizer runs k cheap decode steps per sequence,
  batched over every speculating sequence, on its own paged KV cache. Each sequence's draft KV follows
  the target's accepted tokens: after a verification the draft keeps what it computed for kept tokens
  and drops the rest, so the next round starts by catching up one or two tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from engines.block_manager import BlockManager, BlockTable
from engines.kv.budget import KVBudget
from engines.kv.cache import PagedKVCache, bytes_per_block
from engines.model_runner import Chunk, ModelRunner
from engines.models.llama import LlamaForCausalLM
from engines.sequence import Sequence
from engines.speculative.acceptance import draft_token


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # (k, vocab) the proposer's distributions; None: point masses


class NgramProposer:
    has_probs = False

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft(self.lookup(seq.token_ids, k)) for seq, k in zip(seqs, ks, strict=True)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix (max_n..min_n)."""
        if k < 1 or len(token_ids) < self.min_n + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            windows = sliding_window_view(ids[:-1], n)  # every earlier n-gram that has a successor
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start : start + k].tolist()
        return []

    def prefill(self, seqs: list[Sequence]) -> None:
        """Nothing to compute ahead."""

    def lag(self, seq: Sequence) -> int:
        return 0

    def rollback(self, seq: Sequence) -> None:
        """Nothing to undo: lookups keep no state."""

    def release(self, seq: Sequence) -> None:
        """Nothing held per sequence."""


@dataclass
class _DraftState:
    table: BlockTable
    num_computed: int = 0
    pending: list[int] = field(default_factory=list)  # drafts fed through the model this round


class DraftProposer:
    """A draft model proposing for one target engine; its KV cache is its own `kv_cache_bytes`."""

    has_probs = True

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache_bytes: int,
        block_size: int,
        salt: str = "draft",
        budget: KVBudget | None = None,
    ) -> None:
        """`budget`: draw the draft's blocks from a shared KV budget instead of `kv_cache_bytes`."""
        cfg = model.config
        per_block = bytes_per_block(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, model.dtype
        )
        num_blocks = (budget.total_bytes if budget else kv_cache_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(f"draft kv_cache_bytes={kv_cache_bytes} holds no block of {per_block} bytes")
        self.model = model
        self.cache = PagedKVCache(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks, block_size, model.dtype
        )
        self.block_manager = BlockManager(num_blocks, block_size, budget=budget, block_bytes=per_block, owner=salt)
        self.runner = ModelRunner(model, self.cache)
        self.salt = salt
        self.states: dict[str, _DraftState] = {}
        # (tokens, seconds) since last read: drafting rounds (a token or two per sequence), and prompt
        # computations and catch-ups, which cost per token what drafting rounds don't.
        self.rounds: list[tuple[int, float]] = []
        self.prefills: list[tuple[int, float]] = []

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """k drafts per sequence (fewer where the draft pool is full), batched over sequences."""
        bm = self.block_manager
        live: list[int] = []
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            state = self._state(seq)
            # The draft writes KV for the tokens it lacks and for drafts 1..k-1.
            need = bm.blocks_needed(state.table, len(seq.token_ids) + k - 1)
            if k < 1 or not bm.can_allocate(need, optional=True):
                continue
            bm.allocate(state.table, need)
            state.pending = []
            live.append(i)
        if fresh := bm.first_use:
            self.cache.zero_blocks(fresh)
            fresh.clear()
        drafts = [Draft([]) for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max((ks[i] for i in live), default=0)):
            active = [i for i in live if ks[i] > j]
            chunks = []
            for i in active:
                seq, state = seqs[i], self.states[seqs[i].request_id]
                feed = seq.token_ids[state.num_computed :] if j == 0 else [drafts[i].tokens[-1]]
                chunks.append(Chunk(feed, state.num_computed, state.table.block_ids))
            started = time.perf_counter()
            logits = self.runner.forward(chunks)
            fed = sum(len(c.token_ids) for c in chunks)
            (self.rounds if fed <= 2 * len(chunks) else self.prefills).append((fed, time.perf_counter() - started))
            for row, i in enumerate(active):
                seq, state = seqs[i], self.states[seqs[i].request_id]
                state.num_computed += len(chunks[row].token_ids)
                if j == 0:  # only verified tokens are ever registered in the prefix cache
                    bm.cache_full_blocks(state.table, seq.token_ids, state.num_computed)
                token, q = draft_token(logits[row], seq.sampling)
                drafts[i].tokens.append(token)
                if q is not None:
                    probs[i].append(q)
        for i in live:
            if probs[i]:
                drafts[i].probs = torch.stack(probs[i])
        return drafts

    def _state(self, seq: Sequence) -> _DraftState:
        """The draft's KV state for `seq`, created (with any cached prefix attached) on first use."""
        state = self.states.get(seq.request_id)
        if state is None:
            state = self.states[seq.request_id] = _DraftState(BlockTable(salt=f"{self.salt}|{seq.block_table.salt}"))
            state.num_computed = self.block_manager.match_prefix(state.table, seq.token_ids)
        return state

    def lag(self, seq: Sequence) -> int:
        """Tokens the draft must compute before it can draft for `seq` (1 when in step)."""
        state = self.states.get(seq.request_id)
        return len(seq.token_ids) - (state.num_computed if state else 0)

    def prefill(self, seqs: list[Sequence]) -> None:
        """Compute the draft KV of every token but the newest, in one batched forward: done in the
        step that prefills the target, so the first drafting step has no prompt to catch up on."""
        bm = self.block_manager
        chunks = []
        for seq in seqs:
            state = self._state(seq)
            upto = len(seq.token_ids) - 1
            need = bm.blocks_needed(state.table, upto)
            if upto <= state.num_computed or not bm.can_allocate(need, optional=True):
                continue
            bm.allocate(state.table, need)
            chunks.append(
                (
                    seq,
                    state,
                    Chunk(seq.token_ids[state.num_computed : upto], state.num_computed, state.table.block_ids, 0),
                )
            )
        if not chunks:
            return
        if fresh := bm.first_use:
            self.cache.zero_blocks(fresh)
            fresh.clear()
        started = time.perf_counter()
        self.runner.forward([c for _, _, c in chunks])
        self.prefills.append((sum(len(c.token_ids) for _, _, c in chunks), time.perf_counter() - started))
        for seq, state, c in chunks:
            state.num_computed += len(c.token_ids)
            bm.cache_full_blocks(state.table, seq.token_ids, state.num_computed)

    def rollback(self, seq: Sequence) -> None:
        """After a verification: keep the draft KV of tokens the target kept, drop the rest."""
        state = self.states.get(seq.request_id)
        if state is None:
            return
        # Draft KV is valid for a prefix of the sequence's (verified) tokens: find where they part.
        verified = len(seq.token_ids) - 1  # the last token (correction or bonus) has no KV anywhere yet
        state.num_computed = min(state.num_computed, verified)
        self.block_manager.truncate(state.table, state.num_computed)

    def release(self, seq: Sequence) -> None:
        state = self.states.pop(seq.request_id, None)
        if state is not None:
            self.block_manager.free(state.table)
