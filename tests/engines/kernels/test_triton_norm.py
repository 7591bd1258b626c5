"""The Triton fused residual add + RMSNorm (`engines.kernels.triton_norm`) against `RMSNorm.add_norm`'s torch form,
run on the CPU under the Triton interpreter; each check is shown to catch a deliberately broken kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton_support  # before the kernel modules: it sets TRITON_INTERPRET before they are decorated

from engines.kernels import triton_norm
from engines.kernels.backends import TorchBackend

TOLERANCE = {  # (rtol, atol): the sum of squares runs in another order; the norm is rounded to the dtype
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def torch_add_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: the torch reference backend's form (HF's numerics); it leaves `residual` alone."""
    return TorchBackend().add_rms_norm(x, weight, eps, residual, offset)


def check(
    tokens: int,
    hidden: int,
    dtype: torch.dtype,
    *,
    residual: bool,
    weight_dtype: torch.dtype | None = None,
    eps: float = 1e-6,
    offset: bool = False,
) -> None:
    gen = torch.Generator().manual_seed(tokens * 1000 + hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    res = (torch.randn(tokens, hidden, generator=gen) * 4).to(dtype) if residual else None
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(weight_dtype or dtype)
    expected, expected_r = torch_add_norm(x, weight, eps, res, offset)

    out, r = triton_norm.add_rms_norm(x, weight, eps, res, offset)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    if res is None:
        assert r is x
    else:
        assert r is res  # updated in place, the same one rounding as torch's `residual + x`
        if dtype == torch.bfloat16:
            # The interpreter truncates fp32 -> bf16 (numpy has no bf16; the GPU rounds to nearest even),
            # so here the sum may sit one bf16 step (2^-7 relative) toward zero.
            torch.testing.assert_close(r, expected_r, rtol=2**-7, atol=0)
        else:
            assert torch.equal(r, expected_r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [40, 64, 7])  # 40 and 7: a masked tail in the power-of-two block
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm_matches_torch(tokens: int, hidden: int, dtype: torch.dtype, residual: bool) -> None:
    check(tokens, hidden, dtype, residual=residual)


def test_fp32_weight_promotes_like_torch() -> None:
    """An fp32 weight on fp16 activations gives an fp32 norm, as `weight * h.to(r.dtype)` does."""
    check(3, 40, torch.float16, residual=True, weight_dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
def test_gemma_offset_norm_matches_torch(dtype: torch.dtype, residual: bool) -> None:
    """Gemma's (1 + w) form, multiplied in fp32 and rounded once."""
    check(5, 40, dtype, residual=residual, offset=True)


def test_gemma_offset_norm_keeps_the_activations_dtype() -> None:
    """An fp32 weight on fp16 activations: Gemma's form casts back to the activations' dtype."""
    check(3, 40, torch.float16, residual=True, weight_dtype=torch.float32, offset=True)


def test_strided_rows() -> None:
    """x may be a column slice of a wider buffer (rows farther apart than `hidden`)."""
    x = torch.randn(4, 96)[:, 8:48]
    res = torch.randn(4, 40)
    weight = torch.rand(40) + 0.5
    expected, expected_r = torch_add_norm(x, weight, 1e-6, res)
    out, r = triton_norm.add_rms_norm(x, weight, 1e-6, res)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(r, expected_r)


@pytest.mark.parametrize(
    ("old", "new", "eps"),
    [
        ("r = (res.to(tl.float32) + x.to(tl.float32)).to(x.dtype)", "r = x", 1e-6),  # no residual add
        ("tl.sum(h * h, axis=0) / hidden", "tl.sum(h * h, axis=0)", 1e-6),  # a sum, not the mean
        ("tl.rsqrt(var + eps)", "tl.rsqrt(var)", 0.5),  # eps forgotten (visible with a large one)
    ],
)
def test_broken_kernels_fail(monkeypatch: pytest.MonkeyPatch, old: str, new: str, eps: float) -> None:
    triton_support.poison_new_buffers(monkeypatch)
    broken = triton_support.mutant(triton_norm, "_add_rms_norm_kernel", old, new)
    monkeypatch.setattr(triton_norm, "_add_rms_norm_kernel", broken)
    with pytest.raises(AssertionError):
        check(5, 40, torch.float16, residual=True, eps=eps)


def test_broken_offset_kernel_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scaling by w instead of (1 + w). (Rounding before the multiply, the other form's order, moves the
    result by one rounding of the dtype: inside any tolerance a reordered sum of squares needs.)"""
    triton_support.poison_new_buffers(monkeypatch)
    old, new = "out = h * (1.0 + w.to(tl.float32))", "out = h * w.to(tl.float32)"
    broken = triton_support.mutant(triton_norm, "_add_rms_norm_kernel", old, new)
    monkeypatch.setattr(triton_norm, "_add_rms_norm_kernel", broken)
    with pytest.raises(AssertionError):
        check(5, 40, torch.float16, residual=True, offset=True)


def test_kernel_compiles_for_the_gpu(tmp_path: Path) -> None:
    """The kernel lowers to sm_90 for bf16 rows of Qwen2.5-1.5B's width (1536: not a power of two), with
    and without the residual, in both forms (Gemma's offset too); the variance is a reduction across the
    warps, not one thread's loop."""
    types = dict.fromkeys(["x_ptr", "res_ptr", "w_ptr", "out_ptr"], "*bf16") | {"eps": "fp32"}
    cases = [
        ("_add_rms_norm_kernel", types, {"HAS_RESIDUAL": r, "OFFSET": o, "BLOCK": 2048})
        for r in (True, False)
        for o in (False, True)
    ]
    ptx = triton_support.compile_for_h100("engines.kernels.triton_norm", cases, tmp_path)
    assert all("shfl.sync" in p and "rsqrt" in p for p in ptx)
