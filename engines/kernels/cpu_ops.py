"""Fused decoder ops from our CPU library (`engines/kernels/csrc/cpu_ops.cpp`), each beside the torch code it
replaces, which stays the reference and the fallback (`engines.kernels.reference`; `engines.kernels.backends` picks).

A decode step spent ~17 of its 60 ms (Qwen 1.5B, int4, 2 AVX2 cores) in ~60 small torch ops per layer
and in bf16 attention matmuls, which AVX2 runs without hardware support. Norm, RoPE and SiLU·mul round
where torch rounds, so they agree with it but for the last place of an exp or of a sum's order;
attention is fp32 throughout and computes every query row alone, the same way in a decode step as in
a prefill chunk, so outputs stay independent of batching, chunking and prefix-cache hits.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engines.kernels.cpu_kernels import library

_DTYPES = (torch.bfloat16, torch.float32)


def usable(x: torch.Tensor, width: int) -> bool:
    """Whether the fused ops can take `x` (rows of `width` values): our library, a CPU float tensor."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and width % 8 == 0 and library() is not None


def _bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(r), r) with r = residual + x, the residual updated in place; without one, r = x."""
    lib = library()
    assert lib is not None
    x = x.contiguous()
    m, h = x.shape
    if residual is not None:
        assert residual.is_contiguous() and residual.dtype == x.dtype and residual.shape == x.shape
    w = weight.detach().to(x.dtype).contiguous()
    out = torch.empty_like(x)
    res_ptr = None if residual is None else residual.data_ptr()
    lib.sb_rms_norm(x.data_ptr(), res_ptr, w.data_ptr(), out.data_ptr(), m, h, eps, _bf16(x))
    return out, (x if residual is None else residual)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    """Rotate q (T, q_heads·D) and k (T, k_heads·D) in place; both views of one buffer's rows (one stride).
    cos/sin: (T, ..., D/2) rows of the tables for each token's position."""
    lib = library()
    assert lib is not None
    t = q.shape[0]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and (t <= 1 or q.stride(0) == k.stride(0))
    cos, sin = cos.to(q.dtype).contiguous(), sin.to(q.dtype).contiguous()
    lib.sb_rope(
        q.data_ptr(), q.shape[1] // head_dim, k.data_ptr(), k.shape[1] // head_dim, q.stride(0),
        cos.data_ptr(), sin.data_ptr(), t, head_dim, _bf16(q),
    )  # fmt: skip


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for rows [gate | up]."""
    lib = library()
    assert lib is not None
    gate_up = gate_up.contiguous()
    m, width = gate_up.shape
    out = torch.empty(m, width // 2, dtype=gate_up.dtype)
    lib.sb_silu_mul(gate_up.data_ptr(), out.data_ptr(), m, width // 2, _bf16(gate_up))
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    tables: torch.Tensor,
    row_table: torch.Tensor,
    row_len: torch.Tensor,
    *,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """q (T, H, D) (rows may be strided) over one layer's paged cache → (T, H, D). Row t attends to the last
    `window` of its positions where window > 0; scores are scaled by `scale` (None: D^-0.5).

    k_cache, v_cache: (KVH, blocks, block_size, D), int8 with `scales` (each (KVH, blocks, block_size))
    or in q's dtype; `tables` int32, all sequences' block ids; row t reads them from `row_table[t]` and
    attends to its first `row_len[t]` positions."""
    lib = library()
    assert lib is not None
    t, h, d = q.shape
    kvh, blocks, bs, _ = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == d and k_cache.is_contiguous() and v_cache.is_contiguous()
    out = torch.empty(t, h, d, dtype=q.dtype)
    ks = vs = None
    if scales is not None:
        ks, vs = (s.to(q.dtype).contiguous() for s in scales)
    lib.sb_paged_attention(
        q.data_ptr(), q.stride(0), out.data_ptr(), t, h, kvh, d, k_cache.data_ptr(), v_cache.data_ptr(),
        None if ks is None else ks.data_ptr(), None if vs is None else vs.data_ptr(), int(scales is not None),
        blocks, bs, tables.data_ptr(), row_table.data_ptr(), row_len.data_ptr(), d**-0.5 if scale is None else scale,
        _bf16(q), window,
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class LoraPlan:
    """`lora_add`'s arguments that stay fixed for one layer and one set of adapters: per adapter its A (rank × in)
    and per part it trains (first output column, first column of t, rank, Bᵀ as rank × columns), all in one dtype:
    fp32, or bf16 (a bf16 model's adapters, as loaded: half the bytes)."""

    keep: tuple[torch.Tensor, ...]  # what the pointers point into
    a: ctypes.Array
    ranks: ctypes.Array
    part_group: ctypes.Array
    part_row: ctypes.Array
    part_cols: ctypes.Array
    part_col: ctypes.Array
    part_rank: ctypes.Array
    bt: ctypes.Array
    n_parts: int
    max_rank: int
    in_features: int
    bf16: bool  # the weights' storage (else fp32); the arithmetic is fp32 either way


def lora_plan(
    adapters: list[tuple[torch.Tensor, list[tuple[int, int, int, torch.Tensor]]] | None], in_features: int
) -> LoraPlan:
    """One group per adapter, in the step's order; None: this layer holds none of that adapter (rank 0)."""
    keep: list[torch.Tensor] = []
    a, ranks, groups, rows, cols, firsts, part_ranks, bts = [], [], [], [], [], [], [], []
    dtypes = {adapter[0].dtype for adapter in adapters if adapter is not None}
    assert len(dtypes) == 1 and dtypes <= {torch.float32, torch.bfloat16}, dtypes
    for g, adapter in enumerate(adapters):
        if adapter is None:
            a.append(None), ranks.append(0)
            continue
        weights, parts = adapter
        assert weights.is_contiguous() and weights.shape[1] == in_features
        keep.append(weights)
        a.append(weights.data_ptr())
        ranks.append(weights.shape[0])
        for row, col, rank, bt in parts:
            assert bt.dtype == weights.dtype and bt.is_contiguous() and bt.shape[0] == rank
            keep.append(bt)
            groups.append(g), rows.append(row), cols.append(bt.shape[1]), firsts.append(col), part_ranks.append(rank)
            bts.append(bt.data_ptr())

    def ints(values: list[int]) -> ctypes.Array:
        return (ctypes.c_int * max(1, len(values)))(*values)

    def pointers(values: list[int | None]) -> ctypes.Array:
        return (ctypes.c_void_p * max(1, len(values)))(*values)

    return LoraPlan(tuple(keep), pointers(a), ints(ranks), ints(groups), ints(rows), ints(cols), ints(firsts),
                    ints(part_ranks), pointers(bts), len(groups), max(1, *ranks), in_features,
                    dtypes == {torch.bfloat16})  # fmt: skip


def lora_groups(rows: list[torch.Tensor]) -> tuple[torch.Tensor, ctypes.Array]:
    """A step's rows by adapter as the kernel takes them: all of them (int32), and where each adapter's start."""
    starts = [0]
    for r in rows:
        starts.append(starts[-1] + r.numel())
    return torch.cat(rows).to(torch.int32), (ctypes.c_int * len(starts))(*starts)


def lora_add(x: torch.Tensor, out: torch.Tensor, plan: LoraPlan, rows: list[torch.Tensor]) -> None:
    """out[rows[g], part] += (x[rows[g]] · A_gᵀ)[part's columns] · B_partᵀ for every group g of `plan`, in place;
    each row's bits independent of the other rows (`csrc/lora.cpp`). x, out: CPU bf16 or fp32 rows."""
    lib = library()
    assert lib is not None and x.stride(-1) == 1 and out.stride(-1) == 1 and x.shape[1] == plan.in_features
    flat, starts = lora_groups(rows)
    t = torch.empty(flat.numel(), plan.max_rank)
    lib.sb_lora_add(
        x.data_ptr(), _bf16(x), x.shape[1], x.stride(0), out.data_ptr(), _bf16(out), out.stride(0), len(rows),
        flat.data_ptr(), starts, plan.a, plan.ranks, plan.n_parts, plan.part_group, plan.part_row, plan.part_cols,
        plan.part_col, plan.part_rank, plan.bt, t.data_ptr(), plan.max_rank, int(plan.bf16),
    )  # fmt: skip
