"""CUDA graphs for decode steps: the decoder's forward captured once per bucketed batch size and replayed
with static input buffers, so a decode step costs one graph launch instead of hundreds of kernel launches
(vLLM and SGLang do the same; at small batches the launches, not the math, bound a step).

A decode step of n sequences runs the graph of the smallest bucket >= n. The step's token ids,
positions, KV slots and block tables are copied into the static buffers; padding rows attend to one
position of a scratch block that no sequence owns and write their keys there, so they touch nothing real.
What a graph cannot replay falls back to the eager forward: prefill chunks, batches above the largest
bucket, batches whose block tables together outgrow the table buffer (the largest bucket × the
longest context's blocks), and models whose forward syncs with the host
(quantized MoE experts, which loop over experts by count). The attention backend must read everything from
`AttentionMetadata.rows` (the Triton backend does); the output head runs outside the graph.
"""

from __future__ import annotations

import bisect
import itertools
import logging

import torch

from engines.kernels.metadata import AttentionBackend, AttentionMetadata, DecodeGroup, RowTables
from engines.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def bucket_for(n: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket holding n rows; None above the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        block_size: int,
        scratch_block: int,
        max_blocks_per_seq: int,
        buckets: tuple[int, ...] = BUCKETS,
        replay: bool = True,
    ) -> None:
        """`replay=False` runs the same forward over the same static buffers eagerly, without capturing:
        the buffers' bookkeeping (padding rows, scratch block, tables) checked on the CPU."""
        self.model, self.backend, self.buckets, self.replay = model, backend, buckets, replay
        self.block_size = block_size
        device, rows = model.device, max(buckets)
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), scratch_block * block_size, dtype=torch.long, device=device)
        self.tables = torch.full((rows * max_blocks_per_seq,), scratch_block, dtype=torch.int32, device=device)
        self.row_table = torch.arange(rows, dtype=torch.int32, device=device) * max_blocks_per_seq
        self.row_len = torch.ones(rows, dtype=torch.int32, device=device)
        self.scratch_block = scratch_block
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: object | None = None
        self.disabled = False
        self.steps = 0  # decode steps served from the static buffers

    def metadata(self, rows: int) -> AttentionMetadata:
        """Decode metadata over the static buffers' first `rows` rows."""
        unused = torch.empty(0, device=self.ids.device)
        group = DecodeGroup(0, rows, unused, unused)  # only the Triton backend's row tables are read
        tables = RowTables(self.tables, self.row_table[:rows], self.row_len[:rows])
        no_spans = torch.empty(3, 0, dtype=torch.int32, device=self.ids.device)
        return AttentionMetadata(self.slots[:rows], (group,), (), tables, no_spans)

    def forward(self, rows: int) -> torch.Tensor:
        """The decoder over the static buffers' first `rows` rows: what a graph captures."""
        return self.model(self.ids[:rows], self.positions[:rows], self.backend, self.metadata(rows))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (its memory pool then serves the smaller ones)."""
        if not self.replay:
            return
        try:
            for rows in sorted(self.buckets, reverse=True):
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm up: autotuning and lazy init stay out of the graph
                    self.forward(rows)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self.forward(rows)
                self.pool = graph.pool()
                self.graphs[rows] = (graph, out)
        except RuntimeError as exc:  # e.g. a forward that syncs with the host: serve eagerly
            log.warning("CUDA graphs are off for this model: %s", exc)
            self.graphs.clear()
            self.disabled = True

    def run(
        self, input_ids: list[int], positions: list[int], block_tables: list[list[int]], slots: list[int]
    ) -> torch.Tensor | None:
        """Hidden states (n, hidden) of a decode step of n = len(input_ids) sequences from a graph, or None
        where no graph fits (then the caller runs the eager forward)."""
        n = len(input_ids)
        rows = bucket_for(n, self.buckets)
        if self.disabled or rows is None or (self.replay and rows not in self.graphs):
            return None
        pad = rows - n
        # The rows' tables back to back (row_table: where each starts), padding rows on the scratch block:
        # padding every row to the longest context the buffers allow (2,048 blocks at 32k tokens) built a
        # 131k-int list per step at batch 64, ~10 ms of a 23 ms step on an H200.
        scratch = self.scratch_block
        flat = [b for t in block_tables for b in t] + [scratch] * pad
        if len(flat) > self.tables.numel():
            return None
        starts = [0, *itertools.accumulate(len(t) for t in block_tables)]
        starts = starts[:n] + list(range(starts[n], starts[n] + pad))
        self.ids[:rows].copy_(torch.tensor(input_ids + [0] * pad), non_blocking=True)
        self.positions[:rows].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slots[:rows].copy_(torch.tensor(slots + [scratch * self.block_size] * pad), non_blocking=True)
        lens = [p + 1 for p in positions] + [1] * pad
        self.row_len[:rows].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self.tables[: len(flat)].copy_(torch.tensor(flat, dtype=torch.int32), non_blocking=True)
        self.row_table[:rows].copy_(torch.tensor(starts, dtype=torch.int32), non_blocking=True)
        self.steps += 1
        if not self.replay:
            return self.forward(rows)[:n]
        graph, out = self.graphs[rows]
        graph.replay()
        return out[:n]  # the graph's own buffer: read before the next replay
