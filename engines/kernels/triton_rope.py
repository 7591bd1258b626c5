"""Rotary position embedding on the GPU, in Triton: queries and keys rotated in place, in one launch.

The same rotation as `engines.kernels.reference.apply_rotary` (Neox style, HF's `rotate_half`): each head's first and
second halves x1, x2 become x1·cos − x2·sin and x2·cos + x1·sin. q and k are column slices of the qkv
projection's output, so the kernel rotates them where they lie (no copies), one program per (token, head)
over the query heads then the key heads, the products in fp32 and rounded once (vLLM's and SGLang's
rotary kernels do the same). The torch form rounds each product to the activations' dtype first, so in
16-bit dtypes results may differ from it in the last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    cos_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    stride_q: tl.tensor,
    stride_k: tl.tensor,
    stride_cs: tl.tensor,
    NUM_Q_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim / 2
    BLOCK: tl.constexpr,  # HALF rounded up to a power of two
) -> None:
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    if head < NUM_Q_HEADS:
        x_ptr = q_ptr + token * stride_q + head * 2 * HALF
    else:
        x_ptr = k_ptr + token * stride_k + (head - NUM_Q_HEADS) * 2 * HALF
    cos = tl.load(cos_ptr + token * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + HALF + offs, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(x_ptr + offs, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(x_ptr + HALF + offs, (b * cos + a * sin).to(x1.dtype), mask=mask)


def rotate_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in place on q (tokens, q_heads·D) and k (tokens, k_heads·D), each row contiguous (they may be
    column slices of one buffer); cos, sin (tokens, 1, D/2) as `RotaryEmbedding` gives them. Returns q and
    k viewed as (tokens, heads, D)."""
    n = q.shape[0]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and head_dim % 2 == 0
    assert cos.shape == sin.shape == (n, 1, head_dim // 2) and cos.stride() == sin.stride() and cos.stride(-1) == 1
    q_heads, k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    if n:
        half = head_dim // 2
        _rope_kernel[(n, q_heads + k_heads)](
            q,
            k,
            cos,
            sin,
            q.stride(0),
            k.stride(0),
            cos.stride(0),
            NUM_Q_HEADS=q_heads,
            HALF=half,
            BLOCK=triton.next_power_of_2(half),
        )
    return q.view(n, q_heads, head_dim), k.view(n, k_heads, head_dim)
