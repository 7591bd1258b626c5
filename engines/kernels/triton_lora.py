"""Many LoRA adapters in one step on the GPU, in Triton: each row's low-rank delta added to the base product.

Punica's BGMV (and vLLM's and S-LoRA's Triton forms of it): two kernels, one program per (row, block of
columns), each row reading its own adapter's weights by a slot index (-1: the bare base, nothing added).

- shrink: t[r] = x[r] · A[slot(r)]ᵀ, A stacked (slots, R, in) with every adapter's rank rows padded with zeros to
  the step's widest (R: the sum of its parts' ranks, q/k/v of a fused layer side by side), fp32 sums;
- expand: out[r] += t[r] · B[slot(r)]ᵀ, B stacked (slots, out, R): each part's B in its own output rows and its own
  columns of t, zero elsewhere; summed in fp32 and rounded once into the output's dtype.

The zeros add exactly nothing (x·0 = 0, s + 0 = s), and a row's program reads only that row and its own adapter,
so a sequence's delta has the same bits in any batch: the property `engines.layers.lora` keeps on the CPU. The
products are small (R ≤ 3 × 64), so the columns are reduced with `tl.sum` rather than `tl.dot`, which would need
16 rows of a tile to share one adapter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["lora_add"]


# Parameters annotated `tl.tensor`, as in the other kernel modules: an `int` annotation would force i32.
@triton.jit
def _shrink_kernel(
    x_ptr: tl.tensor,
    a_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    t_ptr: tl.tensor,
    stride_x: tl.tensor,
    stride_slot: tl.tensor,
    stride_rank: tl.tensor,
    stride_t: tl.tensor,
    k_dim: tl.tensor,
    rank: tl.tensor,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)  # int64: rows × stride can pass 2^31 on long prompts
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        rs = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_x + ks, mask=ks < k_dim, other=0.0).to(tl.float32)
            a_rows = a_ptr + slot.to(tl.int64) * stride_slot + rs[:, None] * stride_rank + ks[None, :]
            a = tl.load(a_rows, mask=(rs[:, None] < rank) & (ks[None, :] < k_dim), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(t_ptr + row * stride_t + rs, acc, mask=rs < rank)


@triton.jit
def _expand_kernel(
    t_ptr: tl.tensor,
    b_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    out_ptr: tl.tensor,
    stride_t: tl.tensor,
    stride_slot: tl.tensor,
    stride_n: tl.tensor,
    stride_out: tl.tensor,
    n_dim: tl.tensor,
    rank: tl.tensor,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        rs = tl.arange(0, BLOCK_R)
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.load(t_ptr + row * stride_t + rs, mask=rs < rank, other=0.0)
        b_rows = b_ptr + slot.to(tl.int64) * stride_slot + ns[:, None] * stride_n + rs[None, :]
        b = tl.load(b_rows, mask=(ns[:, None] < n_dim) & (rs[None, :] < rank), other=0.0).to(tl.float32)
        delta = tl.sum(b * t[None, :], axis=1)
        outs = out_ptr + row * stride_out + ns
        base = tl.load(outs, mask=ns < n_dim, other=0.0).to(tl.float32)
        tl.store(outs, (base + delta).to(out_ptr.dtype.element_ty), mask=ns < n_dim)


def lora_add(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """out[r] += (x[r] · A[s]ᵀ) · B[s]ᵀ for s = slots[r] ≥ 0, in place. x (rows, in), out (rows, n), a (slots, R, in),
    b (slots, n, R), slots (rows,) int32: each row's adapter, -1 for none."""
    assert x.dim() == 2 and out.dim() == 2 and x.shape[0] == out.shape[0] == slots.shape[0]
    assert a.shape[0] == b.shape[0] and a.shape[1] == b.shape[2], "A (slots, R, in) and B (slots, n, R)"
    assert a.shape[2] == x.shape[1] and b.shape[1] == out.shape[1], "A's inputs are x's, B's outputs out's"
    assert out.stride(1) == 1, "out is updated in place: its rows must be contiguous"
    rows, (_, rank, k_dim), n_dim = x.shape[0], a.shape, out.shape[1]
    if rows == 0 or rank == 0:
        return
    x, a, b, slots = x.contiguous(), a.contiguous(), b.contiguous(), slots.to(torch.int32).contiguous()
    t = torch.empty(rows, rank, dtype=torch.float32, device=x.device)
    block_r = triton.next_power_of_2(rank)
    block_k = max(16, min(128, 8192 // block_r))  # a (BLOCK_R × BLOCK_K) tile of A in registers
    _shrink_kernel[(rows,)](x, a, slots, t, x.stride(0), a.stride(0), a.stride(1), t.stride(0), k_dim, rank,
                            BLOCK_R=block_r, BLOCK_K=block_k)  # fmt: skip
    block_n = max(16, min(128, 8192 // block_r))
    _expand_kernel[(rows, triton.cdiv(n_dim, block_n))](t, b, slots, out, t.stride(0), b.stride(0), b.stride(1),
                                                         out.stride(0), n_dim, rank, BLOCK_R=block_r,
                                                         BLOCK_N=block_n)  # fmt: skip
