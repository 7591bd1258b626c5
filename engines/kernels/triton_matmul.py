"""Weight-only quantized matmuls on the GPU, in Triton: y = x @ dequant(W).T (+ bias).

Activations stay floating point; the weight is read in its quantized form (`engines.kernels.quantize` formats,
unchanged) and dequantized tile by tile in registers, so each step reads 1 or 0.5 bytes a weight instead of
2. Each program computes one BLOCK_M x BLOCK_N output tile: it walks K in BLOCK_K slices, loads an x tile
and the matching weight codes, turns the codes into the activations' dtype and accumulates `tl.dot` in fp32
(tensor cores for fp16/bf16), the plain tiled GEMM of the Triton matmul tutorial with a dequantizing
B-operand load. This is the shape of the weight-only Triton kernels of gptq-triton (AutoGPTQ's Triton
backend) and vLLM's `awq_triton`; unlike those we keep torch's int4 convention
((code - 8) * scale + zero with the zero in the float domain, two codes a byte along K, low nibble first)
so the CPU's packed weights serve the GPU as they are.

- int8 (per output channel): codes are exact in fp16/bf16, so the dot runs on raw codes and the scale is
  applied once per output column after the K loop (scale distributes over the sum).
- int4 (groups along K): scale and zero change every `group_size` inputs, so they are applied to the
  weight tile before the dot; BLOCK_K divides the group, so each K tile has one scale and zero per column.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from engines.kernels.quantize import QuantizedWeight


# Kernel parameters are annotated `tl.tensor`, what they are inside a kernel: Triton reads an annotation
# such as `int` as a forced i32 type, while `tl.tensor` leaves its specialization alone.
@triton.jit
def _store_tile(
    acc: tl.tensor,
    b_ptr: tl.tensor,
    out_ptr: tl.tensor,
    offs_m: tl.tensor,
    offs_n: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    stride_om: tl.tensor,
    stride_on: tl.tensor,
    HAS_BIAS: tl.constexpr,
) -> None:
    """Shared epilogue: bias in fp32, one rounding to the output dtype, masked for ragged M and N edges."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int8_matmul_kernel(
    x_ptr: tl.tensor,
    q_ptr: tl.tensor,
    s_ptr: tl.tensor,
    b_ptr: tl.tensor,
    out_ptr: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    stride_xm: tl.tensor,
    stride_xk: tl.tensor,
    stride_qn: tl.tensor,
    stride_qk: tl.tensor,
    stride_om: tl.tensor,
    stride_on: tl.tensor,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    # q is (N, K); the dot wants W.T, so the tile is read as (BLOCK_K, BLOCK_N) by swapping the strides.
    q_ptrs = q_ptr + offs_k[:, None] * stride_qk + offs_n[None, :] * stride_qn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kt * BLOCK_K  # the last tile may be ragged: masked lanes load 0 and add nothing
        a = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(q_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)  # |code| <= 127: exact in fp16
        x_ptrs += BLOCK_K * stride_xk
        q_ptrs += BLOCK_K * stride_qk
    scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    acc = acc * scale[None, :]
    _store_tile(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS)


@triton.jit
def _int4_matmul_kernel(
    x_ptr: tl.tensor,
    p_ptr: tl.tensor,
    s_ptr: tl.tensor,
    z_ptr: tl.tensor,
    b_ptr: tl.tensor,
    out_ptr: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    group_size: tl.tensor,
    stride_xm: tl.tensor,
    stride_xk: tl.tensor,
    stride_pn: tl.tensor,
    stride_pk: tl.tensor,
    stride_sn: tl.tensor,
    stride_sg: tl.tensor,
    stride_om: tl.tensor,
    stride_on: tl.tensor,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m[:, None] < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    # Input k's code is in byte k // 2, in the low nibble when k is even (`unpack_int4`). Each byte is
    # loaded for both of its columns (the second load hits L1), as gptq-triton does with its shifter.
    p_ptrs = p_ptr + (offs_k[:, None] // 2) * stride_pk + offs_n[None, :] * stride_pn
    shift = (offs_k[:, None] % 2) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K is a multiple of the group and the group of BLOCK_K, so no K tile is ragged.
    for kt in range(0, K // BLOCK_K):
        a = tl.load(x_ptrs, mask=m_mask, other=0.0)
        packed = tl.load(p_ptrs, mask=n_mask[None, :], other=0).to(tl.int32)
        codes = (packed >> shift) & 0xF
        g = (kt * BLOCK_K) // group_size  # the whole tile lies in one group
        scale = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=n_mask, other=0.0)
        zero = tl.load(z_ptr + offs_n * stride_sn + g * stride_sg, mask=n_mask, other=0.0)
        # Dequantize in fp32 exactly as `QuantizedWeight.dequantize`, then round once to x's dtype.
        w = (codes.to(tl.float32) - 8.0) * scale[None, :] + zero[None, :]
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        p_ptrs += (BLOCK_K // 2) * stride_pk
    _store_tile(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS)


def _block_m(m: int) -> int:
    # tl.dot needs every tile side >= 16; decode (M = a few rows) wastes the rest of a 16-row tile,
    # which costs little since the weight read dominates there.
    return min(64, max(16, triton.next_power_of_2(m)))


def _dot_precision(x: torch.Tensor) -> str:
    # fp32 activations would default to TF32 (10-bit mantissa) on the GPU; keep them exact.
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _prepare(x: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as 2-D (M, K) rows and the (M, N) output in x's dtype."""
    assert x.shape[-1] == k, f"x has {x.shape[-1]} inputs, the weight {k}"
    x2 = x.reshape(-1, k)
    return x2, torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)


def int8_weight_matmul(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (M, K) @ (q * scales[:, None]).T (+ bias): q int8 (N, K), scales fp32 (N,). Output in x's dtype."""
    n, k = q.shape
    assert q.dtype == torch.int8 and scales.shape == (n,)
    x2, out = _prepare(x, n, k)
    m = x2.shape[0]
    block_m, block_n, block_k = _block_m(m), 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    if m:
        _int8_matmul_kernel[grid](
            x2,
            q,
            scales.contiguous(),
            bias,  # None is fine: the HAS_BIAS=False kernel never touches it
            out,
            m,
            n,
            k,
            x2.stride(0),
            x2.stride(1),
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            HAS_BIAS=bias is not None,
            DOT_PRECISION=_dot_precision(x2),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
    return out.view(*x.shape[:-1], n)


def int4_weight_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (M, K) @ W.T (+ bias) for W = (code - 8) * scale + zero per group of `group_size` inputs: packed
    uint8 (N, K/2) two codes a byte (low nibble = even column), scales and zeros fp32 (N, K/group_size).
    Output in x's dtype. The group must be a multiple of 16 (the smallest `tl.dot` tile)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    assert packed.dtype == torch.uint8 and k % group_size == 0
    assert scales.shape == zeros.shape == (n, k // group_size) and scales.stride() == zeros.stride()
    # The largest power of two dividing the group (at most 64), so a K tile never straddles two groups.
    block_k = min(group_size & -group_size, 64)
    assert block_k >= 16, f"group size {group_size} is not a multiple of 16"
    x2, out = _prepare(x, n, k)
    m = x2.shape[0]
    block_m, block_n = _block_m(m), 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    if m:
        _int4_matmul_kernel[grid](
            x2,
            packed,
            scales,
            zeros,
            bias,
            out,
            m,
            n,
            k,
            group_size,
            x2.stride(0),
            x2.stride(1),
            packed.stride(0),
            packed.stride(1),
            scales.stride(0),
            scales.stride(1),
            out.stride(0),
            out.stride(1),
            HAS_BIAS=bias is not None,
            DOT_PRECISION=_dot_precision(x2),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
    return out.view(*x.shape[:-1], n)


def matmul_for(qw: QuantizedWeight) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """`f(x, bias)` computing x @ qw.dequantize().T (+ bias) with the matching kernel. qw's tensors must
    already be on x's device."""
    if qw.format == "int8":
        # `outliers` only matter to int8 x int8 kernels, which quantize activations and keep those
        # channels out of them; here activations stay floating point, so the whole weight is just
        # q * scale and the outlier channels need no split.
        def int8(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            return int8_weight_matmul(x, qw.q, qw.scales, bias)

        return int8
    assert qw.zeros is not None

    def int4(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int4_weight_matmul(x, qw.q, qw.scales, qw.zeros, qw.group_size, bias)

    return int4
