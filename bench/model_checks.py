"""The two oracles `bench.models` and the family tests share: every position's logits through the paged
cache as the engine computes them, and llama.cpp's negative log-likelihood of the same token ids."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engines.kernels.metadata import AttentionBackend, AttentionMetadata
from engines.kv.cache import PagedKVCache


def logits_in_pieces(
    model: torch.nn.Module,
    ids: torch.Tensor,
    cuts: list[int],
    block: int = 4,
    backend: Callable[[PagedKVCache], AttentionBackend] | None = None,
) -> torch.Tensor:
    """Every position's logits: a prefill to cuts[0], chunks to the other cuts, then one-token decodes, with
    the sequence's blocks scattered over the pool; over `backend(cache)`, else the engine's attention backend
    for this device."""
    from engines.kernels.backends import backend_for

    cfg = model.config
    needed = -(-len(ids) // block)
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, needed + 3, block, model.dtype)
    cache.zero_blocks(list(range(needed + 3)))
    table = torch.randperm(needed + 3, generator=torch.Generator().manual_seed(0))[:needed].tolist()
    attention = backend(cache) if backend is not None else backend_for(cache.buffer).attention(cache, cfg)
    out, start = [], 0
    with torch.inference_mode():
        for end in [*cuts, *range(cuts[-1] + 1, len(ids) + 1)]:
            meta = AttentionMetadata.build(block, [table], [start], [end - start])
            out.append(model.compute_logits(model(ids[start:end], torch.arange(start, end), attention, meta)))
            start = end
    return torch.cat(out)


def llamacpp_nll(gguf: Path, windows: list[list[int]]) -> list[float]:
    """llama.cpp's NLL of tokens 1.. of each window given what precedes them in it (fresh context each)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=max(map(len, windows)), logits_all=True, verbose=False, n_batch=512)
    nll: list[float] = []
    for ids in windows:
        llm.reset()
        llm.eval(ids)
        logits = torch.tensor(llm.scores[: len(ids) - 1], dtype=torch.float64)
        logprobs = torch.log_softmax(logits, dim=-1)
        nll += (-logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)).tolist()
    return nll
