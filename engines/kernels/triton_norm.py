"""Fused residual add + RMSNorm on the GPU, in Triton: one program per token row.

The same numerics as `RMSNorm.add_norm`'s torch form (engines/layers/blocks.py), which is HF's: r = residual + x
rounded to the activations' dtype, normalized in fp32, rounded back to that dtype, then multiplied by the
weight. The kernel reads x (and the residual) once and writes the norm (and the new residual) once: the
unfused form takes four passes over memory. It does what vLLM's `fused_add_rms_norm` and FlashInfer's
`fused_add_rmsnorm` (SGLang's) CUDA kernels do, residual updated in place as our CPU path does, written
like the Triton tutorial's layer norm with the whole row in one block (hidden sizes are a few thousand).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Kernel parameters are annotated `tl.tensor`, what they are inside a kernel: Triton reads an annotation
# such as `int` as a forced i32 type, while `tl.tensor` leaves its specialization alone.
@triton.jit
def _add_rms_norm_kernel(
    x_ptr: tl.tensor,
    res_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    stride_x: tl.tensor,
    stride_res: tl.tensor,
    stride_out: tl.tensor,
    hidden: tl.tensor,
    eps: tl.tensor,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)  # int64: rows × stride can pass 2^31 on long prompts
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden  # BLOCK is a power of two; hidden need not be
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Sum in fp32 and round once to the activations' dtype, as torch's `residual + x` does.
        r = (res.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_res + cols, r, mask=mask)  # the residual stream, updated in place
    else:
        r = x
    h = r.to(tl.float32)
    var = tl.sum(h * h, axis=0) / hidden  # masked lanes are 0 and add nothing
    h = h * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if OFFSET:  # noqa: SIM108 (a constexpr branch: one form compiled per kernel)
        # Gemma: scaled by (1 + w) in fp32, rounded once on the store.
        out = h * (1.0 + w.to(tl.float32))
    else:
        # HF rounds the normalized row to the activations' dtype *before* the weight multiply.
        out = w.to(tl.float32) * h.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(r), r) for r = residual + x (r = x without a residual); `residual` is updated in place and
    returned. x: (tokens, hidden). The norm's dtype is torch's promotion of the weight's and x's, as in
    `weight * h.to(r.dtype)`; with `offset` (Gemma's `(h * (1 + w)).to(r.dtype)`) it is x's."""
    assert x.dim() == 2, "rows of (tokens, hidden)"
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, hidden = x.shape
    if residual is not None:
        # In place only works on the caller's tensor itself, so no silent copies here.
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    weight = weight.detach().contiguous()
    out_dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(m, hidden, dtype=out_dtype, device=x.device)
    if m:
        block = triton.next_power_of_2(hidden)
        res = x if residual is None else residual  # a placeholder pointer when there is none
        _add_rms_norm_kernel[(m,)](
            x,
            res,
            weight,
            out,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            OFFSET=offset,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),  # ~8 values a thread: wide rows get more warps
        )
    return out, (x if residual is None else residual)
