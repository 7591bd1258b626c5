"""The model runner: turns a scheduled batch into one forward pass over the paged KV cache, then samples.

Sequences are laid out flat, one-token queries first (decodes), then multi-token chunks, so one set
of matmuls serves every sequence: the weights are read once per step however many sequences ride.
Only the rows that end a sequence's target are turned into logits.

A step with a single token runs it twice: bf16 matmuls take another kernel for one row than for two or
more, whose rows are bit-identical for any row count, so padding keeps a lone request's greedy answer
the same as when it shares steps with others (see `engines.attention` for the attention half).
"""

from __future__ import annotations

import torch

from engines import cpu_attention
from engines.attention import AttentionMetadata, TorchPagedAttention
from engines.kv_cache import PagedKVCache
from engines.models.llama import LlamaForCausalLM
from engines.sampling import sample
from engines.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        cfg = model.config
        native = cpu_attention.supports(cache, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.backend = cpu_attention.NativePagedAttention(cache) if native else TorchPagedAttention(cache)
        # Float models pad a lone token to two rows (below). Our quantized kernels compute every row
        # alone whatever the row count, so padding would only double their work (~20% of a step).
        self.pad_lone = model.weights_format == "bf16"

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new: list[int]) -> list[int | None]:
        """Compute `num_new[i]` tokens of `seqs[i]`; returns the sampled next token of each sequence
        whose target is now fully computed, None for the others (chunks of a longer prefill)."""
        # Decodes first, shortest context first, so attention pads each group of them the least.
        order = sorted(
            range(len(seqs)), key=lambda i: (num_new[i] != 1, seqs[i].num_computed if num_new[i] == 1 else 0)
        )
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        for i in order:
            seq, n = seqs[i], num_new[i]
            done = seq.num_computed
            input_ids.extend(seq.token_ids[done : done + n])
            positions.extend(range(done, done + n))
            if done + n == len(seq.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(i)
        tables = [seqs[i].block_table.block_ids for i in order]
        computed = [seqs[i].num_computed for i in order]
        new = [num_new[i] for i in order]
        if len(input_ids) == 1 and self.pad_lone:  # one row takes another matmul kernel: run it twice
            input_ids, positions, tables, computed, new = (
                input_ids * 2,
                positions * 2,
                tables * 2,
                computed * 2,
                new * 2,
            )
        meta = AttentionMetadata.build(self.cache.block_size, tables, computed, new)
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.backend, meta)
        result: list[int | None] = [None] * len(seqs)
        if sample_rows:
            pad = len(sample_rows) == 1 and self.pad_lone
            rows = sample_rows * 2 if pad else sample_rows  # the lm_head too: never one row
            logits = self.model.compute_logits(hidden[rows])[: len(sample_rows)]
            tokens = sample(logits, [seqs[i].sampling for i in sample_seqs])
            for i, token in zip(sample_seqs, tokens, strict=True):
                result[i] = token
        return result
