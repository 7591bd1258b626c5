"""The model runner: turns a step's chunks into one forward pass over the paged KV cache, and logits.

Sequences are laid out flat, one-token queries first (decodes), then multi-token chunks, so one set
of matmuls serves every sequence: the weights are read once per step however many sequences ride.
Only the rows whose logits are needed (the end of a sequence's target, or every verified position
of a speculative step) go through the output head.

A step with a single token runs it twice: bf16 matmuls take another kernel for one row than for two or
more, whose rows are bit-identical for any row count, so padding keeps a lone request's greedy answer
the same as when it shares steps with others (see `engines.kernels.reference` for the attention half).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engines.cuda_graphs import DecodeGraphs
from engines.kernels.backends import backend_for
from engines.kernels.metadata import AttentionMetadata
from engines.kernels.quantize import quantize_int8
from engines.kv.cache import PagedKVCache
from engines.layers.linear import Linear
from engines.layers.lora import LoraBatch, lora_batch
from engines.models.llama import HiddenTaps, LlamaForCausalLM


@dataclass(frozen=True)
class Chunk:
    """Tokens of one sequence to compute: `token_ids` at positions num_computed..; the last
    `num_logits` of them get logits. `block_ids` must cover every position. `hidden_layer`: keep the
    residual stream of its last token after that many layers (`ModelRunner.hidden`)."""

    token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    num_logits: int = 1
    hidden_layer: int | None = None
    adapter: str | None = None  # the LoRA adapter its rows run under (`engines.layers.lora`); None: the base


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend_for(cache.buffer).attention(cache, model.config)
        # Float models pad a lone token to two rows (below). Our quantized kernels compute every row
        # alone whatever the row count, so padding would only double their work (~20% of a step).
        self.pad_lone = model.weights_format == "bf16"
        self.vocab: torch.Tensor | None = None  # set with `restrict_vocab`: the only ids given logits
        self.head: Linear | None = None
        self.graphs: DecodeGraphs | None = None  # CUDA only: see `enable_cuda_graphs`
        self.hidden: dict[int, torch.Tensor] = {}  # the last forward's kept hidden states, by chunk index

    def enable_cuda_graphs(self, scratch_block: int, max_blocks_per_seq: int, replay: bool = True) -> None:
        """Replay decode steps from CUDA graphs; `scratch_block` is a cache block no sequence ever gets.
        `replay=False`: the graphs' static-buffer forward, run eagerly (see `DecodeGraphs`)."""
        from engines.cuda_graphs import DecodeGraphs

        bs = self.cache.block_size
        graphs = DecodeGraphs(self.model, self.backend, bs, scratch_block, max_blocks_per_seq, replay=replay)
        graphs.capture()
        self.graphs = None if graphs.disabled else graphs

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Compute logits for `ids` only (a draft's cheap head); the rest read -inf."""
        self.vocab, self.head = ids, restricted_head(self.model, ids)

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], on_device: bool = False) -> torch.Tensor:
        """One forward over every chunk; float32 logits (Σ num_logits, vocab), in chunk order, on the CPU
        (`on_device`: left where the model runs). The hidden states chunks ask for (`Chunk.hidden_layer`)
        are in `self.hidden` until the next forward."""
        self.hidden = {}
        adapters = any(c.adapter is not None for c in chunks)  # graphs replay the base's products only
        decodes = all(len(c.token_ids) == 1 and c.num_logits == 1 for c in chunks)
        if self.graphs is not None and not adapters and decodes:
            bs = self.cache.block_size
            slots = [c.block_ids[c.num_computed // bs] * bs + c.num_computed % bs for c in chunks]
            hidden = self.graphs.run(
                [c.token_ids[0] for c in chunks], [c.num_computed for c in chunks], [c.block_ids for c in chunks], slots
            )
            if hidden is not None:
                return self._logits(hidden, len(chunks), on_device)
        # Decodes first, shortest context first, so attention pads each group of them the least.
        order = sorted(
            range(len(chunks)),
            key=lambda i: (
                len(chunks[i].token_ids) != 1,
                chunks[i].num_computed if len(chunks[i].token_ids) == 1 else 0,
            ),
        )
        input_ids: list[int] = []
        positions: list[int] = []
        rows_of: dict[int, list[int]] = {}
        for i in order:
            c = chunks[i]
            input_ids.extend(c.token_ids)
            positions.extend(range(c.num_computed, c.num_computed + len(c.token_ids)))
            rows_of[i] = list(range(len(input_ids) - c.num_logits, len(input_ids)))
        tables = [chunks[i].block_ids for i in order]
        computed = [chunks[i].num_computed for i in order]
        new = [len(chunks[i].token_ids) for i in order]
        if len(input_ids) == 1 and self.pad_lone:  # one row takes another matmul kernel: run it twice
            input_ids, positions, tables, computed, new = (x * 2 for x in (input_ids, positions, tables, computed, new))
        device = self.model.device
        meta = AttentionMetadata.build(self.cache.block_size, tables, computed, new).to(device)
        ids, pos = torch.tensor(input_ids, device=device), torch.tensor(positions, device=device)
        taps, where = self._taps(chunks, order)
        batch = self._adapter_rows(chunks, order, len(input_ids), device) if adapters else None
        with lora_batch(batch):
            hidden = self.model(ids, pos, self.backend, meta, taps)
        if taps is not None:
            self.hidden = {i: taps.states[layer][j].cpu() for i, (layer, j) in where.items()}
        rows = [r for i in range(len(chunks)) for r in rows_of[i]]
        if not rows:
            return torch.empty(0, self.model.config.vocab_size)
        pad = len(rows) == 1 and self.pad_lone
        return self._logits(hidden[rows * 2 if pad else rows], len(rows), on_device)  # the lm_head: never one row

    @staticmethod
    def _adapter_rows(chunks: list[Chunk], order: list[int], rows: int, device: torch.device) -> LoraBatch:
        """The flat rows of each adapter's chunks (a lone token's doubled row too: it runs twice)."""
        by: dict[str, list[int]] = {}
        start = 0
        for i in order:
            n = len(chunks[i].token_ids)
            if (name := chunks[i].adapter) is not None:
                by.setdefault(name, []).extend(range(start, start + n))
            start += n
        if rows == 2 * start:  # `pad_lone`: the one token's copy
            by = {name: [*r, *(x + start for x in r)] for name, r in by.items()}
        return LoraBatch.of(by, device)

    @staticmethod
    def _taps(chunks: list[Chunk], order: list[int]) -> tuple[HiddenTaps | None, dict[int, tuple[int, int]]]:
        """The flat rows of the last tokens whose hidden states are asked for, by layer; and where each
        asking chunk's state will be: chunk index → (layer, index among that layer's rows)."""
        ends = list(itertools.accumulate(len(chunks[i].token_ids) for i in order))
        rows: dict[int, list[int]] = {}
        where: dict[int, tuple[int, int]] = {}
        for pos, i in enumerate(order):
            if (layer := chunks[i].hidden_layer) is not None:
                rows.setdefault(layer, []).append(ends[pos] - 1)
                where[i] = (layer, len(rows[layer]) - 1)
        return (HiddenTaps(rows) if rows else None), where

    def _logits(self, hidden: torch.Tensor, n: int, on_device: bool = False) -> torch.Tensor:
        """Float32 logits of the first `n` rows of `hidden`, on the CPU (where the sampler runs) unless
        `on_device`."""
        device = hidden.device if on_device else torch.device("cpu")
        if self.head is None:
            return self.model.compute_logits(hidden)[:n].to(device)
        logits = torch.full((n, self.model.config.vocab_size), float("-inf"), device=device)
        logits[:, self.vocab] = self.model.cap_logits(self.head(hidden)[:n].float()).to(device)
        return logits


@torch.inference_mode()
def restricted_head(model: LlamaForCausalLM, ids: torch.Tensor) -> Linear:
    """A head computing the logits of `ids` only, in the model's head format (int8 stays int8)."""
    head = model.lm_head
    hidden = model.config.hidden_size
    # The head applied to the identity gives its (dequantized) weights whatever kernel holds them.
    weight = head(torch.eye(hidden, dtype=model.dtype)).float()[:, ids].T.contiguous()
    sub = Linear(hidden, len(ids))
    if head.format == "bf16":
        sub.weight = torch.nn.Parameter(weight.to(model.dtype), requires_grad=False)
        sub.prepare()
    else:
        sub.set_quantized(quantize_int8(weight), model.dtype)
    return sub
