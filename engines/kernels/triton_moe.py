"""Fused sparse-MoE forward on the GPU: two grouped GEMMs in Triton (after vLLM's and SGLang's fused_moe).

`SparseMoE.forward` on the CPU loops over experts; on a GPU that is E small launches per layer, most of them
for a handful of rows. Here the whole MoE MLP is three launches (gate/up GEMM, SiLU·mul, down GEMM):

- Sort by expert (`align_by_expert`). The T·k (token, slot) pairs are grouped by the expert they chose, and
  each expert's run is padded to a multiple of BLOCK_M with a sentinel pair (T·k). Every BLOCK_M tile of the
  sorted list then belongs to exactly one expert, so a program loads one expert's weight tiles and multiplies
  them by up to BLOCK_M gathered token rows: each expert's weights are read once per tile of its tokens (once
  in all at decode), and experts no token chose have no tiles and are never read. Sentinel rows are masked:
  never loaded, never stored. Nothing is read back to the host: the lists are sized by a bound known from
  the shapes (`max_padded`) and the GEMMs skip tiles past the real count, which they read on the device, so
  a decode step through the MoE can be captured in a CUDA graph.
- One grouped-GEMM kernel (`_grouped_gemm_kernel`) serves both projections. Weights are stacked (E, N, K), the
  nn.Linear layout (out, in), so no transposed copy is made. GEMM 1 gathers input row pair // k of x (a token
  is shared by its k pairs) and writes the pair's row of a (T·k, 2I) gate/up buffer; GEMM 2 reads row `pair`
  of the (T·k, I) activations and writes row `pair` of a (T·k, H) buffer.
- The routing weight is applied in GEMM 2's epilogue, in fp32 before the output's rounding, so the k slots of
  a token only need a plain sum afterwards (a reshape and sum in torch): no atomics, and a deterministic order.

Accumulation is fp32 everywhere; intermediates are stored in x's dtype, as vLLM does. fp32 operands use IEEE
dots (not TF32) so results match torch's fp32 matmul closely.

Production code imports this module only when CUDA is present (it imports triton at the top); the tests run it
on the CPU under the Triton interpreter (`tests/engines/kernels/triton_support.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from engines.kernels.reference import MoELayer

BLOCK_M = 16  # rows (pairs) per tile: the smallest tl.dot tile; decode routes few tokens per expert


def max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows `align_by_expert` can need: each used expert (at most one per pair) pads its run by
    up to block_m - 1. Known from shapes alone, so a CUDA graph can be captured around the MoE."""
    return -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pairs, expert_of_block, num_padded) for (T, k) expert ids, without a host sync.

    sorted_pairs (max_padded,) int32: the flat pair indices t·k + slot grouped by expert (ascending, stable),
    each expert's run padded with the sentinel T·k to a multiple of `block_m`, then sentinels to the
    shape-only bound `max_padded`. expert_of_block (max_padded // block_m,) int32: the expert owning each
    tile (tiles past the end: the last expert; the kernel skips them). num_padded (1,) int32, on the
    device: the rows actually used. Experts with no pairs get no tiles.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    # scatter_add, not bincount: on CUDA bincount reads the ids' max back to the host.
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded  # where each expert's run begins in sorted_pairs
    count_start = torch.cumsum(counts, 0) - counts  # where it begins in the unpadded sorted order
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    # Position j of the unpadded order is the (j - count_start[e])-th pair of its expert e.
    dest = padded_start[experts] + torch.arange(num_pairs, device=flat.device) - count_start[experts]
    rows = max_padded(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((rows,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[dest] = order.to(torch.int32)
    # Tile b belongs to the first expert whose padded run ends after its first row.
    tile_start = torch.arange(0, rows, block_m, device=flat.device)
    owner = torch.searchsorted(padded_end, tile_start, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, owner.to(torch.int32), padded_end[-1:].to(torch.int32)


# Inside a kernel every non-constexpr argument (pointer or scalar) is a tl.tensor; that annotation leaves
# Triton's specialization alone (only constexpr and dtype names such as "i32" or "*fp16" change it).
@triton.jit
def _grouped_gemm_kernel(
    a_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    scale_ptr: tl.tensor,
    sorted_pairs_ptr: tl.tensor,
    expert_of_block_ptr: tl.tensor,
    num_padded_ptr: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    num_pairs: tl.tensor,
    stride_am: tl.tensor,
    stride_ak: tl.tensor,
    stride_we: tl.tensor,
    stride_wn: tl.tensor,
    stride_wk: tl.tensor,
    stride_om: tl.tensor,
    stride_on: tl.tensor,
    ROWS_PER_A: tl.constexpr,  # pairs per input row: k when a is x (GEMM 1), 1 when a is per pair (GEMM 2)
    APPLY_SCALE: tl.constexpr,  # multiply each row by its pair's routing weight (GEMM 2)
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    """out[pair, n] = (scale[pair] ·) Σ_k a[pair // ROWS_PER_A, k] · w[expert, n, k] for one tile of pairs."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # the grid is sized by the bound, not the count
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs  # sentinel (padding) rows: neither loaded nor stored
    rows = pairs // ROWS_PER_A
    expert = tl.load(expert_of_block_ptr + pid_m).to(tl.int64)  # one expert per tile, by construction
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    # w[expert] is (N, K); read as its transpose (BLOCK_K, BLOCK_N) tile so the dot is a @ w.T.
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K  # the last K tile may be partial
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if APPLY_SCALE:
        scale = tl.load(scale_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr: tl.tensor,
    out_ptr: tl.tensor,
    inter: tl.tensor,
    stride_gm: tl.tensor,
    stride_om: tl.tensor,
    BLOCK: tl.constexpr,
    GELU: tl.constexpr = False,
) -> None:
    """out[row] = act(gate) · up for gate_up[row] = [gate (inter) | up (inter)]; fp32 math, in out's dtype.
    act: SiLU, or GELU's tanh approximation (`GELU`: Gemma's GeGLU), tanh(y) written as 2·sigmoid(2y) - 1."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    gate = tl.load(gate_up_ptr + row * stride_gm + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_gm + inter + offs, mask=ok, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # √(2/π) (x + 0.044715 x³)
        act = 0.5 * gate * (2.0 * tl.sigmoid(2.0 * inner)) * up  # 0.5 x (1 + tanh(inner))
    else:
        act = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_om + offs, act.to(out_ptr.dtype.element_ty), mask=ok)


def _tile(size: int, cap: int) -> int:
    """A power-of-two tile covering `size` up to `cap`, at least 16 (tl.dot's smallest)."""
    return max(16, min(cap, triton.next_power_of_2(size)))


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    sorted_pairs: torch.Tensor,
    expert_of_block: torch.Tensor,
    num_padded: torch.Tensor,
    rows_per_a: int,
    scale: torch.Tensor | None,
    block_m: int,
) -> None:
    n, k = w.shape[1], w.shape[2]
    block_n, block_k = _tile(n, 64), _tile(k, 64)
    grid = (expert_of_block.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        scale if scale is not None else out,  # unread when APPLY_SCALE is off
        sorted_pairs,
        expert_of_block,
        num_padded,
        n,
        k,
        out.shape[0],
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        ROWS_PER_A=rows_per_a,
        APPLY_SCALE=scale is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # ignored for 16-bit operands
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def gelu_tanh_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """`silu_mul` with GELU-tanh in place of SiLU: Gemma's GeGLU on the GPU."""
    return silu_mul(gate_up, inter, gelu=True)


def silu_mul(gate_up: torch.Tensor, inter: int, *, gelu: bool = False) -> torch.Tensor:
    """silu(gate) · up for rows [gate | up] of width 2·inter (the fused gate/up projection's output), in
    one pass: (..., inter) in gate_up's dtype. Also the dense SwiGLU's activation on the GPU."""
    rows = gate_up.reshape(-1, 2 * inter)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    act = torch.empty(rows.shape[0], inter, dtype=rows.dtype, device=rows.device)
    if rows.shape[0]:
        block = _tile(inter, 1024)
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, act, inter, rows.stride(0), act.stride(0), block, GELU=gelu
        )
    return act.view(*gate_up.shape[:-1], inter)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Σ_k topk_weights[t, k] · down_e(silu(gate_e(x_t)) · up_e(x_t)) for e = topk_ids[t, k]: (T, H) in x's dtype.

    x (T, H); w_gate_up (E, 2I, H), gate rows first; w_down (E, H, I); topk_weights, topk_ids (T, k).
    """
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if w_gate_up.shape != (num_experts, two_i, hidden) or w_down.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"expert weights {tuple(w_gate_up.shape)}, {tuple(w_down.shape)} do not fit x {tuple(x.shape)}"
        )
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w_gate_up = w_gate_up.to(x.dtype)
    w_down = w_down.to(x.dtype)
    num_pairs = num_tokens * top_k
    sorted_pairs, expert_of_block, num_padded = align_by_expert(topk_ids, num_experts, BLOCK_M)
    gate_up = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w_gate_up, gate_up, sorted_pairs, expert_of_block, num_padded, top_k, None, BLOCK_M)
    act = silu_mul(gate_up, inter)
    down = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    scale = topk_weights.reshape(-1).contiguous()  # pair p = t·k + slot, the same flat order as the ids
    _grouped_gemm(act, w_down, down, sorted_pairs, expert_of_block, num_padded, 1, scale, BLOCK_M)
    # Each pair's row is already weighted: a token's output is the plain sum of its k rows.
    return down.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


def stacked_expert_weights(moe: MoELayer) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_gate_up (E, 2I, H), w_down (E, H, I)): a sparse MoE layer's float expert weights stacked for `fused_moe`.

    Only plain float Linear weights can be stacked: quantized experts (int8/int4 kernels) or bf16 weights
    already replaced by oneDNN's packed layout have no (out, in) float matrix left.
    """
    gate_up, down = [], []
    for i, expert in enumerate(moe.experts):
        for name, linear, into in (
            ("gate_up_proj", expert.gate_up_proj, gate_up),
            ("down_proj", expert.down_proj, down),
        ):
            if linear.kernel is not None:
                raise ValueError(f"expert {i} {name} is quantized ({linear.format}); fused_moe needs float weights")
            if linear.weight is None:
                raise ValueError(f"expert {i} {name} holds only a packed weight; fused_moe needs the float matrix")
            if linear.bias is not None:
                raise ValueError(f"expert {i} {name} has a bias; fused_moe has none")
            into.append(linear.weight.detach())
    return torch.stack(gate_up), torch.stack(down)
