"""The scheduler: which sequences compute how many tokens in the next step.

vLLM's rule with no phases: every sequence needs `len(token_ids) - num_computed` tokens and gets
`min(needed, budget left)` of them, under `max_num_batched_tokens` tokens and `max_num_seqs`
sequences per step. Long prompts are prefilled in chunks across steps, prefix-cache hits start with
`num_computed > 0`, and decodes (one token each) ride in the same batch.

Running sequences go first, in admission order, then waiting ones by (priority, arrival). When blocks
run out, the newest running sequence (lowest priority first) is preempted: its blocks are freed and it
waits to be recomputed, reusing whatever of its prefix is still cached.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.block_manager import BlockManager
from engines.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        restore: Callable[[Sequence, int], int] | None = None,
    ) -> None:
        """`restore(seq, hit)`: after a local prefix match of `hit` tokens, attach more computed blocks
        from elsewhere (the KV tier) and return the tokens now covered."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.restore = restore
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []  # in the order they were admitted
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=_order)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.block_manager.free(seq.block_table)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            if not self._reserve(seq, n, i, batch):
                break  # seq itself was preempted: no blocks are left for the rest either
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
            i += 1
        if batch.preempted:  # memory is tight: admit nobody new this step
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            table = seq.block_table
            hit = 0
            if not table.block_ids:
                hit = bm.match_prefix(table, seq.token_ids)
                if self.restore is not None:
                    hit = self.restore(seq, hit)
                seq.num_computed = hit
            n = min(seq.num_uncomputed, budget)
            need = bm.blocks_needed(table, seq.num_computed + n)
            if not bm.can_allocate(need):
                bm.free(table)  # give back the prefix hits; try again when memory frees up
                seq.num_computed = 0
                break
            bm.record_lookup(len(seq.token_ids), hit)
            if seq.cached_tokens < 0:  # billed once: a preempted sequence's recompute is our cost, not theirs
                seq.cached_tokens = min(hit, seq.prompt_len)
            bm.allocate(table, need)
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
        return batch

    def _reserve(self, seq: Sequence, n: int, index: int, batch: ScheduledBatch) -> bool:
        """Get blocks for `n` more tokens of running[index], preempting later sequences as needed."""
        bm = self.block_manager
        while True:
            need = bm.blocks_needed(seq.block_table, seq.num_computed + n)
            if bm.can_allocate(need):
                bm.allocate(seq.block_table, need)
                return True
            # Only sequences not scheduled yet this step may go: running[index:].
            victim = max(self.running[index:], key=_order)  # least important, then newest
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)


def _order(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival
