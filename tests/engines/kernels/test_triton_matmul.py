"""The Triton weight-only quantized matmuls (`engines.kernels.triton_matmul`) against x @
`QuantizedWeight.dequantize()`.T on real quantized weights (`engines.kernels.quantize`), run on the CPU under the
Triton interpreter (bf16 compiled on a CUDA device: the interpreter cannot run it); each check is shown to
catch a deliberately broken kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton_support  # before the kernel modules: it sets TRITON_INTERPRET before they are decorated

from engines.kernels import triton_matmul
from engines.kernels.quantize import QuantizedWeight, outlier_channels, quantize_int4, quantize_int8

TOLERANCE = {  # (rtol, atol): fp32 sums in another order; fp16 rounds x·w's inputs and the output
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),  # fp16's for three fewer mantissa bits (8x the rounding)
}
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=triton_support.BF16_NEEDS_CUDA)]


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Per-column offsets so int4 groups have nonzero zero points worth getting right.
    return torch.randn(n, k, generator=gen) * 0.1 + torch.randn(1, k, generator=gen) * 0.05


def check(
    f: object, qw: QuantizedWeight, m: int, dtype: torch.dtype, *, bias: bool = False, x: torch.Tensor | None = None
) -> None:
    """f(x, bias) against the fp32 oracle x @ qw.dequantize().T (+ bias), in x's dtype."""
    n, k = qw.shape
    gen = torch.Generator().manual_seed(m * 7 + n)
    x = (torch.randn(m, k, generator=gen) if x is None else x).to(dtype)
    b = (torch.randn(n, generator=gen) * 0.5).to(dtype) if bias else None
    expected = x.float() @ qw.dequantize().T
    if b is not None:
        expected += b.float()
    out = f(x, b)  # type: ignore[operator]
    assert out.dtype == dtype and out.shape == (m, n)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)


def int8_f(qw: QuantizedWeight, gpu: bool = False) -> object:
    """The int8 kernel as f(x, bias): interpreted here, or compiled on the GPU (`triton_support.on_gpu`)."""
    if gpu:
        return lambda x, b: triton_support.on_gpu("matmul", "int8", x, qw.q, qw.scales, None, 0, b)
    return lambda x, b: triton_matmul.int8_weight_matmul(x, qw.q, qw.scales, b)


def int4_f(qw: QuantizedWeight, gpu: bool = False) -> object:
    assert qw.zeros is not None
    if gpu:
        return lambda x, b: triton_support.on_gpu("matmul", "int4", x, qw.q, qw.scales, qw.zeros, qw.group_size, b)
    return lambda x, b: triton_matmul.int4_weight_matmul(x, qw.q, qw.scales, qw.zeros, qw.group_size, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), [(32, 24), (64, 40), (96, 72)])  # 96: a ragged second K tile of 64
@pytest.mark.parametrize("m", [1, 3, 17])
def test_int8_matches_dequantized(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    qw = quantize_int8(weight(n, k, seed=k + n))
    check(int8_f(qw, gpu=dtype == torch.bfloat16), qw, m, dtype, bias=m == 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("k", "n", "group"),
    [(32, 24, 32), (64, 40, 32), (64, 40, 16), (256, 72, 128)],  # 128: two K tiles of 64 share a group
)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_int4_matches_dequantized(m: int, k: int, n: int, group: int, dtype: torch.dtype) -> None:
    qw = quantize_int4(weight(n, k, seed=k + n), group)
    check(int4_f(qw, gpu=dtype == torch.bfloat16), qw, m, dtype, bias=m == 3)


def test_many_tiles_and_strided_x() -> None:
    """Several M and N tiles (M 70 > 64, N 136 > 2·64) and x a column slice of a wider buffer."""
    x = torch.randn(70, 100)[:, 4:68]
    int8, int4 = quantize_int8(weight(136, 64, 1)), quantize_int4(weight(136, 64, 2))
    check(int8_f(int8), int8, 70, torch.float32, x=x)
    check(int4_f(int4), int4, 70, torch.float16, bias=True, x=x)


def test_matmul_for_picks_the_kernel() -> None:
    """`matmul_for` serves both formats; a calibrated int8 weight's outlier channels need no split here."""
    w = weight(40, 64, 3)
    calibrated = quantize_int8(w, outliers=outlier_channels(torch.rand(64)))
    assert calibrated.outliers is not None
    for qw in (calibrated, quantize_int4(w)):
        check(triton_matmul.matmul_for(qw), qw, 3, torch.float16, bias=True)
        check(triton_matmul.matmul_for(qw), qw, 5, torch.float32)
    # Leading dimensions are flattened into rows and restored.
    x = torch.randn(2, 3, 64)
    out = triton_matmul.matmul_for(calibrated)(x, None)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, x @ calibrated.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("acc = acc * scale[None, :]", "acc = acc * scale[None, :] * scale[None, :]"),  # scale applied twice
        ("tl.cdiv(K, BLOCK_K)", "K // BLOCK_K"),  # the ragged last K tile (96 = 64 + 32) skipped
    ],
)
# Mutants stay inside the tensors' bounds: the interpreter reads raw addresses and would not notice.
def test_int8_broken_kernels_fail(monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    triton_support.poison_new_buffers(monkeypatch)
    broken = triton_support.mutant(triton_matmul, "_int8_matmul_kernel", old, new)
    monkeypatch.setattr(triton_matmul, "_int8_matmul_kernel", broken)
    qw = quantize_int8(weight(40, 96, 4))
    with pytest.raises(AssertionError):
        check(int8_f(qw), qw, 17, torch.float32)


def test_epilogue_without_bias_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared epilogue is called by global name, so one broken copy breaks both kernels' bias."""
    triton_support.poison_new_buffers(monkeypatch)
    broken = triton_support.mutant(triton_matmul, "_store_tile", "acc += tl.load(", "acc -= tl.load(")
    monkeypatch.setattr(triton_matmul, "_store_tile", broken)
    int8, int4 = quantize_int8(weight(40, 64, 6)), quantize_int4(weight(40, 64, 6))
    for f, qw in ((int8_f(int8), int8), (int4_f(int4), int4)):
        check(f, qw, 3, torch.float32)  # no bias: unaffected
        with pytest.raises(AssertionError):
            check(f, qw, 3, torch.float32, bias=True)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("shift = (offs_k[:, None] % 2) * 4", "shift = (1 - offs_k[:, None] % 2) * 4"),  # nibbles swapped
        ("* scale[None, :] + zero[None, :]", "* scale[None, :]"),  # zero point dropped
        ("codes.to(tl.float32) - 8.0", "codes.to(tl.float32)"),  # the -8 offset forgotten
        ("g = (kt * BLOCK_K) // group_size", "g = 0"),  # every tile scaled as the first group
    ],
)
def test_int4_broken_kernels_fail(monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    triton_support.poison_new_buffers(monkeypatch)
    broken = triton_support.mutant(triton_matmul, "_int4_matmul_kernel", old, new)
    monkeypatch.setattr(triton_matmul, "_int4_matmul_kernel", broken)
    qw = quantize_int4(weight(40, 256, 5), 128)
    with pytest.raises(AssertionError):
        check(int4_f(qw), qw, 3, torch.float32)


def test_kernels_compile_for_the_gpu(tmp_path: Path) -> None:
    """Both kernels lower to sm_90 for bf16 activations (decode's 16-row tile and prefill's 64), with and
    without a bias, and dequantize into tensor-core MMAs."""
    common = {"x_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "s_ptr": "*fp32"}
    int8 = common | {"q_ptr": "*i8"}
    int4 = common | {"p_ptr": "*u8", "z_ptr": "*fp32"}
    cases = []
    for block_m, bias in ((16, False), (64, True)):
        consts = {"HAS_BIAS": bias, "DOT_PRECISION": "tf32", "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64}
        cases += [("_int8_matmul_kernel", int8, consts), ("_int4_matmul_kernel", int4, consts)]
    ptx = triton_support.compile_for_h100("engines.kernels.triton_matmul", cases, tmp_path)
    assert all("mma" in p for p in ptx), "a weight-only matmul did not lower to tensor-core MMAs"
