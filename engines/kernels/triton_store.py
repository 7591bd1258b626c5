"""Writing a step's new keys and values into the paged KV pool on the GPU (`engines.kv.cache.PagedKVCache`).

`_store_kv_kernel` (`store_kv`) writes each new token's key and value vectors into their slots, one program
per (token, KV head), like vLLM's `reshape_and_cache`. With an int8 pool it quantizes the vector in-kernel
bit for bit like `engines.kv.cache.quantize`. `engines.kernels.triton_attention` runs it first in every layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engines.kv.cache import PagedKVCache


@triton.jit
def _round_half_even(x: tl.tensor) -> tl.tensor:
    """torch.round on fp32: to nearest, ties to even. (libdevice.rint does this on the GPU but not
    under the interpreter; floor and an exact fractional part work on both.)"""
    down = tl.floor(x)
    frac = x - down  # exact for |x| >= 1 (Sterbenz); in (-1, 0) its rounding cannot cross 0.5
    odd = (down - 2.0 * tl.floor(down * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, down + 1.0, down)


@triton.jit
def _store_vector(src: tl.tensor, dst: tl.tensor, scale_dst: tl.tensor, QUANT: tl.constexpr) -> None:
    """Copy one (token, KV head) vector into the pool; int8: as `engines.kv.cache.quantize` does."""
    x = tl.load(src)
    if QUANT:
        xf = x.to(tl.float32)
        # div_rn: IEEE division like torch (a plain `/` on fp32 may lower to an approximate divide).
        scale = tl.math.div_rn(tl.max(tl.abs(xf), axis=0), 127.0).to(scale_dst.dtype.element_ty)
        divisor = scale.to(tl.float32)  # the stored (rounded) scale, so q * scale tracks x
        divisor = tl.where(divisor == 0.0, 1.0, divisor)
        q = _round_half_even(tl.math.div_rn(xf, divisor))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(scale_dst, scale)
        tl.store(dst, q.to(tl.int8))
    else:
        tl.store(dst, x)


@triton.jit
def _store_kv_kernel(
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    slot_mapping: tl.tensor,
    k_cache: tl.tensor,  # this layer's (kv_heads, blocks, block_size, dim) keys / values
    v_cache: tl.tensor,
    k_scales: tl.tensor,  # int8 only: this layer's (kv_heads, blocks, block_size) scales
    v_scales: tl.tensor,
    stride_kt: int,
    stride_kh: int,
    stride_vt: int,
    stride_vh: int,
    stride_ch: int,
    stride_cs: int,
    stride_sh: int,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
) -> None:
    token = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)  # int64: offsets into a large pool can pass 2**31
    slot = tl.load(slot_mapping + token).to(tl.int64)
    offs = tl.arange(0, HEAD_DIM)
    cache_offs = head * stride_ch + slot * stride_cs + offs
    scale_offs = head * stride_sh + slot
    src_k = k_ptr + token * stride_kt + head * stride_kh + offs
    src_v = v_ptr + token * stride_vt + head * stride_vh + offs
    _store_vector(src_k, k_cache + cache_offs, k_scales + scale_offs, QUANT)
    _store_vector(src_v, v_cache + cache_offs, v_scales + scale_offs, QUANT)


def store_kv(cache: PagedKVCache, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """`PagedKVCache.store` on the device: k/v (tokens, kv_heads, dim) into `slot_mapping`'s slots."""
    tokens, kv_heads, dim = k.shape
    if tokens == 0:
        return
    check_head_dim(dim)
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v need contiguous head_dim"
    k_cache, v_cache = cache.layer(layer)
    scales = cache.layer_scales(layer)
    check_layout(k_cache, v_cache, scales)
    k_scales, v_scales = scales if scales is not None else (k_cache, v_cache)  # unused without QUANT
    _store_kv_kernel[(tokens, kv_heads)](
        k,
        v,
        slot_mapping,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(2),
        k_scales.stride(0),
        HEAD_DIM=dim,
        QUANT=scales is not None,
    )


def check_head_dim(dim: int) -> None:
    assert dim >= 16 and dim & (dim - 1) == 0, f"head_dim {dim} must be a power of two >= 16 (tl.arange, tl.dot)"


def check_layout(
    k_cache: torch.Tensor, v_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None
) -> None:
    """The kernels address a slot as one stride over (blocks, block_size) and head_dim as contiguous."""
    for cache in (k_cache, v_cache):
        assert cache.stride(3) == 1 and cache.stride(1) == cache.shape[2] * cache.stride(2), "unexpected cache layout"
    assert k_cache.stride() == v_cache.stride()
    if scales is not None:
        for s in scales:
            assert s.stride(2) == 1 and s.stride(1) == s.shape[2] and s.stride() == scales[0].stride()
