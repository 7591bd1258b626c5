"""Kernel calls run by `triton_support.on_gpu` in a child process of the test run, where Triton is imported
without TRITON_INTERPRET so the kernels compile for the CUDA device (the test process's Triton is set up for
the interpreter). Usage: `python tests/triton_compiled.py DEVICE CALLS RESULTS`: CALLS holds (runner, args)
pairs (`torch.save`), each runner's result is written to RESULTS, on the CPU. DEVICE `cpu` (with
TRITON_INTERPRET=1) runs the same calls interpreted: the round trip's own check.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from engines.kv.cache import PagedKVCache


def matmul(
    fmt: str,
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    from engines.kernels import triton_matmul

    if fmt == "int8":
        return triton_matmul.int8_weight_matmul(x, q, scales, bias)
    assert zeros is not None
    return triton_matmul.int4_weight_matmul(x, q, scales, zeros, group_size, bias)


def attention(
    cache: PagedKVCache, num_splits: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object
) -> tuple[torch.Tensor, PagedKVCache]:
    """Layer 0's attention (storing k and v first): its output and the cache it wrote."""
    from engines.kernels.triton_attention import TritonPagedAttention

    return TritonPagedAttention(cache, num_splits).forward(0, q, k, v, meta), cache  # type: ignore[arg-type]


def store(cache: PagedKVCache, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> PagedKVCache:
    from engines.kernels.triton_store import store_kv

    store_kv(cache, layer, slots, k, v)
    return cache


def moe(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    from engines.kernels.triton_moe import fused_moe

    return fused_moe(x, w_gate_up, w_down, weights, ids)


RUNNERS: dict[str, Callable[..., Any]] = {f.__name__: f for f in (matmul, attention, store, moe)}


def place(obj: Any, device: str) -> Any:
    """Tensors (also inside tuples, lists and KV caches, which move in place) on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, PagedKVCache):
        obj.buffer = obj.buffer.to(device)
        obj.scales = None if obj.scales is None else obj.scales.to(device)
        return obj
    if isinstance(obj, tuple | list):
        return type(obj)(place(o, device) for o in obj)
    return obj


def main(device: str, calls_path: str, results_path: str) -> None:
    calls = torch.load(calls_path, weights_only=False)
    results = [place(RUNNERS[runner](*place(args, device)), "cpu") for runner, args in calls]
    torch.save(results, results_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
