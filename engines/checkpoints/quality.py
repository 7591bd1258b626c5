"""Perplexity of a model variant on held-out text, through the engine itself.

Whatever the engine does to the numbers (quantized weights, an int8 KV cache) shows up in them; compare
a variant against its bf16 original on the same machine. Teacher-forced over non-overlapping windows of
the token stream: each window is a fresh sequence whose KV is written through the real paged path in
chunks, so later chunks attend to keys and values read back from the cache; logits are taken for every
position and the negative log-likelihood of each next token is summed in fp32/fp64. The first token of a
window is context only. Nothing touches the prefix cache, and the blocks are freed afterwards.
GSM8K accuracy, the other half of the quality gate, is `gateway.model_quality`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from engines.block_manager import BlockTable
from engines.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:  # only the engine's parts are used: the engine sits above the checkpoints
    from engines.engine import Engine

# --- perplexity ------------------------------------------------------------------------------------


@torch.inference_mode()
def token_nll(
    engine: Engine, token_ids: list[int], *, window: int = 1024, chunk: int = 128, progress: bool = False
) -> torch.Tensor:
    """Negative log-likelihood (fp32) of every scored token of `token_ids`, in order.

    The stream is cut into windows of `window` tokens (capped at the engine's context); each window
    scores tokens 1..end given everything before them in that window, computed `chunk` tokens per
    forward over the paged KV cache. A window of one token scores nothing."""
    if window < 2 or chunk < 1:
        raise ValueError("window must be at least 2 tokens and chunk at least 1")
    window = min(window, engine.max_model_len)
    model, backend, cache, blocks = engine.runner.model, engine.runner.backend, engine.cache, engine.block_manager
    starts = [s for s in range(0, len(token_ids), window) if len(token_ids) - s >= 2]
    scored: list[torch.Tensor] = []
    for start in tqdm(starts, desc="perplexity", unit="window", disable=not progress):
        ids = token_ids[start : start + window]
        table = BlockTable(salt="quality")  # never registered in the prefix cache
        needed = blocks.blocks_needed(table, len(ids))
        if not blocks.can_allocate(needed):
            raise MemoryError(f"a {len(ids)}-token window needs {needed} KV blocks, {blocks.num_free} are free")
        blocks.allocate(table, needed)
        try:
            if fresh := blocks.first_use:  # as `Engine.step` does: clear blocks before their first use
                cache.zero_blocks(fresh)
                fresh.clear()
            targets = torch.tensor(ids[1:])
            for done in range(0, len(ids) - 1, chunk):  # the last token is a target only
                n = min(chunk, len(ids) - 1 - done)
                tables, computed, new = [table.block_ids], [done], [n]
                inputs, positions = ids[done : done + n], list(range(done, done + n))
                if n == 1 and engine.runner.pad_lone:  # a lone bf16 row runs twice, like the model runner
                    tables, computed, new, inputs, positions = (
                        tables * 2,
                        computed * 2,
                        new * 2,
                        inputs * 2,
                        positions * 2,
                    )
                meta = AttentionMetadata.build(cache.block_size, tables, computed, new)
                hidden = model(torch.tensor(inputs), torch.tensor(positions), backend, meta)
                logprobs = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)[:n]
                picked = logprobs.gather(1, targets[done : done + n].unsqueeze(1)).squeeze(1)
                scored.append(-picked)
        finally:
            blocks.free(table)
    return torch.cat(scored) if scored else torch.empty(0)


def perplexity(
    engine: Engine, token_ids: list[int], *, window: int = 1024, chunk: int = 128, progress: bool = False
) -> float:
    """exp(mean next-token NLL) of `token_ids` through the engine; see `token_nll`."""
    nll = token_nll(engine, token_ids, window=window, chunk=chunk, progress=progress)
    if not len(nll):
        raise ValueError("nothing to score: need at least 2 tokens")
    return math.exp(nll.double().mean().item())


# --- GSM8K -----------------------------------------------------------------------------------------
