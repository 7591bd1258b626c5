"""Our AVX2 kernels (`engines.kernels.cpu_kernels`) against torch emulations of exactly what they compute, against
the float product within quantization error, and with deliberately broken layouts that must fail."""

from __future__ import annotations

import shutil

import pytest
import torch

from engines.kernels import cpu_kernels as ck
from engines.kernels.quantize import QuantizedWeight, pack_int4, quantize_int4, quantize_int8, unpack_int4

pytestmark = pytest.mark.skipif(
    not ck._cpu_has_avx2() or ck._compiler() is None, reason="needs an AVX2 CPU and a C++ compiler"
)

# (N, K): groups per row of 3, 5 (odd: a half-used pair), 8 (one full chunk), 9 and 18 (a short last
# chunk), 48; N not a multiple of the 4-row blocks.
SHAPES = [(37, 96), (96, 160), (16, 256), (13, 288), (50, 576), (64, 1536)]


def test_the_kernels_build_and_load_here() -> None:
    # A machine with a compiler and AVX2 must get the fast path, not a silent fallback.
    assert ck.available()


def emulate_acts(x: torch.Tensor, group: int = 32, bits: int = 8) -> torch.Tensor:
    """The activations the kernels multiply with: integer codes × their group's scale (int4 weights
    take 8-bit activations per 32 values, int8 weights 7-bit ones per `group`)."""
    q, d, _ = ck.reference_quantize_acts(x, group, bits)
    return q.float() * d.repeat_interleave(group, dim=1)[:, : x.shape[1]]


def emulate_int4_weight(qw: QuantizedWeight) -> torch.Tensor:
    """The weight the int4 kernel multiplies with: scale and min = zero - 8·scale rounded to fp16."""
    n, k = qw.shape
    assert qw.zeros is not None
    codes = unpack_int4(qw.q).float().view(n, k // 32, 32)
    scale = qw.scales.half().float()
    low = (qw.zeros - 8 * qw.scales).half().float()
    return (codes * scale[..., None] + low[..., None]).view(n, k)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("bits", [8, 7])
@pytest.mark.parametrize("group", [32, 96, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_matches_the_reference(dtype: torch.dtype, group: int, bits: int) -> None:
    torch.manual_seed(0)
    x = (torch.randn(7, 608) * torch.logspace(-3, 2, 608)).to(dtype)  # groups of very different ranges
    x[2, :group] = 0  # an all-zero group: scale 0, codes 0
    q, d, s = ck.quantize_acts(x, group, bits)  # 608 = 2·256 + 96: a shorter last group
    rq, rd, rs = ck.reference_quantize_acts(x, group, bits)
    assert q.abs().max() == 2 ** (bits - 1) - 1
    assert torch.equal(q, rq)
    assert torch.equal(d, rd)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=1e-6)
    assert (q[2, :group] == 0).all() and d[2, 0] == 0


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_int4_kernel_computes_exactly_its_emulation(n: int, k: int, rows: int) -> None:
    torch.manual_seed(n * k + rows)
    w = torch.randn(n, k) * 0.05
    qw = quantize_int4(w)
    x = torch.randn(rows, k)
    out = ck.int4_linear(x, ck.Int4Weights(qw), out_dtype=torch.float32)
    assert rel(out, emulate_acts(x) @ emulate_int4_weight(qw).T) < 2e-6  # fp32 summation order only
    # And within quantization error of the float product (int8 activations, int4 weights).
    assert rel(out, x @ w.T) < 0.15
    assert rel(out, x @ qw.dequantize().T) < 0.02


@pytest.mark.parametrize("group", [32, 128, ck.INT8_ACT_GROUP])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_int8_kernel_computes_exactly_its_emulation(n: int, k: int, rows: int, group: int) -> None:
    torch.manual_seed(n * k + rows)
    w = torch.randn(n, k) * 0.05
    qw = quantize_int8(w)
    x = torch.randn(rows, k)
    out = ck.int8_linear(x, ck.Int8Weights(qw, group), out_dtype=torch.float32)
    assert rel(out, emulate_acts(x, group, bits=7) @ qw.dequantize().T) < 2e-6
    assert rel(out, x @ w.T) < 0.03


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_int8_outlier_channels_stay_out_of_the_int8_activations(rows: int) -> None:
    torch.manual_seed(6)
    n, k = 40, 576
    w = torch.randn(n, k) * 0.05
    x = torch.randn(rows, k)
    x[:, [3, 300]] *= 200  # two channels far above the rest, as in real decoders
    outliers = torch.tensor([3, 300])
    qw = quantize_int8(w, outliers=outliers)
    out = ck.int8_linear(x, ck.Int8Weights(qw), out_dtype=torch.float32)
    inliers = x.index_fill(1, outliers, 0.0)
    expected = (
        emulate_acts(inliers, ck.INT8_ACT_GROUP, bits=7) @ qw.dequantize().T
        + x[:, outliers] @ qw.dequantize()[:, outliers].T
    )
    assert rel(out, expected) < 2e-6
    # Against the float product, measured on the ordinary channels' share of the output (which the
    # outliers swamp): kept in the int8 activations, the outliers flatten every other channel.
    ordinary = (inliers @ qw.dequantize().T).norm()
    assert (out - x @ qw.dequantize().T).norm() / ordinary < 0.02
    plain = ck.int8_linear(x, ck.Int8Weights(quantize_int8(w)), out_dtype=torch.float32)
    assert (plain - x @ qw.dequantize().T).norm() / ordinary > 0.1


def test_bias_and_bf16_output() -> None:
    torch.manual_seed(3)
    w, bias = torch.randn(50, 576) * 0.05, torch.randn(50)
    x = torch.randn(4, 576).bfloat16()
    for kernel, weights in ((ck.int4_linear, ck.Int4Weights(quantize_int4(w))), (ck.int8_linear, None)):
        weights = weights or ck.Int8Weights(quantize_int8(w))
        full = kernel(x, weights, out_dtype=torch.float32)
        out = kernel(x, weights, bias)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, (full + bias).bfloat16())  # rounded once, to nearest even


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_row_does_not_depend_on_its_batch(fmt: str) -> None:
    torch.manual_seed(4)
    w = torch.randn(64, 1536) * 0.05
    x = torch.randn(9, 1536).bfloat16()
    if fmt == "int4":
        weights, kernel = ck.Int4Weights(quantize_int4(w)), ck.int4_linear
    else:
        weights, kernel = ck.Int8Weights(quantize_int8(w)), ck.int8_linear
    batched = kernel(x, weights)
    for i in range(9):
        assert torch.equal(kernel(x[i : i + 1], weights), batched[i : i + 1])


def test_broken_layouts_fail_the_check() -> None:
    torch.manual_seed(5)
    n, k = 64, 576
    w = torch.randn(n, k) * 0.05
    x = torch.randn(4, k)
    ref = emulate_acts(x) @ quantize_int4(w).dequantize().T
    good = ck.Int4Weights(quantize_int4(w))
    assert rel(ck.int4_linear(x, good, out_dtype=torch.float32), ref) < 0.01
    # The two groups of every pair in each other's nibbles (their scales left in place), or the rows
    # of each 4-row block in reverse order, must be caught.
    qw = quantize_int4(w)
    codes = unpack_int4(qw.q).view(n, k // 64, 2, 32).flip(2).reshape(n, k)
    swapped = QuantizedWeight("int4", pack_int4(codes), qw.scales, qw.zeros, qw.group_size)
    assert rel(ck.int4_linear(x, ck.Int4Weights(swapped), out_dtype=torch.float32), ref) > 0.5
    q8 = quantize_int8(w)
    ref8 = emulate_acts(x, ck.INT8_ACT_GROUP, bits=7) @ q8.dequantize().T
    rows = ck.Int8Weights(q8)  # the 16 rows of each slab in reverse
    rows.packed = rows.packed.view(n // ck.SLAB, -1, ck.SLAB, 4).flip(2).contiguous().view(-1)
    assert rel(ck.int8_linear(x, rows, out_dtype=torch.float32), ref8) > 0.5


def test_no_compiler_means_no_native_kernels(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with monkeypatch.context() as m:
        m.setattr(shutil, "which", lambda _: None)
        m.delenv("CXX", raising=False)
        ck.build_of.cache_clear()
        try:
            assert ck.library() is None
        finally:
            ck.build_of.cache_clear()
    assert "no C++ compiler" in caplog.text  # said once, in the log, instead of failing to serve
    assert ck.available()
