"""The native CPU kernels come in one build per instruction set (AVX2; AVX-512 VNNI), picked once from the
CPU's flags or forced by `SWITCHBOARD_CPU_KERNELS`; every build computes the same numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.kernels import cpu_kernels
from engines.kernels.quantize import quantize_int4, quantize_int8
from tiny import tiny_hf_model

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the native kernels are off on this machine")
VNNI = pytest.mark.skipif(not cpu_kernels.supported("avx512-vnni"), reason="this CPU has no AVX-512 VNNI")


def test_the_build_follows_the_cpu_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWITCHBOARD_CPU_KERNELS", raising=False)
    widest = "avx512-vnni" if {"avx512_vnni", "avx512vl", "avx512bw"} <= cpu_kernels.cpu_flags() else "avx2"
    assert cpu_kernels.variant() == widest
    monkeypatch.setenv("SWITCHBOARD_CPU_KERNELS", "avx2")
    assert cpu_kernels.variant() == "avx2"
    monkeypatch.setenv("SWITCHBOARD_CPU_KERNELS", "sse4")
    with pytest.raises(ValueError, match="SWITCHBOARD_CPU_KERNELS"):
        cpu_kernels.chosen_variant()


def linear(fmt: str, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's x·wᵀ, and the weight its codes stand for."""
    if fmt == "int4":
        qw = quantize_int4(w)
        return cpu_kernels.int4_linear(x, cpu_kernels.Int4Weights(qw)), qw.dequantize()
    qw = quantize_int8(w, outliers=torch.tensor([3, 200]) if fmt == "int8-outliers" else None)
    return cpu_kernels.int8_linear(x, cpu_kernels.Int8Weights(qw)), qw.dequantize()


@VNNI
@pytest.mark.parametrize("fmt", ["int8", "int8-outliers", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 37])  # a decode row, a small batch, a prefill chunk past the row tiles
def test_every_build_computes_the_same_numbers(fmt: str, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(rows)
    w = torch.randn(76, 544)  # 19 row blocks; K = 17 groups of 32 (ragged against int8's 256-input groups)
    x = torch.randn(rows, 544, dtype=torch.bfloat16)
    out = {}
    for variant in cpu_kernels.VARIANTS:
        monkeypatch.setenv("SWITCHBOARD_CPU_KERNELS", variant)
        assert cpu_kernels.variant() == variant
        out[variant], dequantized = linear(fmt, x, w)
    assert torch.equal(out["avx2"], out["avx512-vnni"])
    reference = x.float() @ dequantized.T  # and both are the product, to the activations' quantization
    assert (out["avx2"].float() - reference).abs().max() < 0.03 * reference.abs().max()


def test_engine_stats_name_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.engine import Engine, EngineConfig

    model_dir = tiny_hf_model("llama", tmp_path)
    for forced in ("avx2", None):
        if forced:
            monkeypatch.setenv("SWITCHBOARD_CPU_KERNELS", forced)
        else:
            monkeypatch.delenv("SWITCHBOARD_CPU_KERNELS", raising=False)
        engine = Engine.from_dir(model_dir, weights="int8", config=EngineConfig(kv_cache_bytes=1 << 20))
        assert engine.stats().as_dict()["kernels"] == (forced or cpu_kernels.variant())


@pytest.mark.parametrize(("n", "k"), [(76, 544), (13, 288), (64, 1536), (40, 96), (24, 8960)])
@pytest.mark.parametrize("group", [32, 128, cpu_kernels.INT8_ACT_GROUP])
@pytest.mark.parametrize("outliers", [False, True])
def test_an_int8_row_gets_the_same_bits_in_any_batch_on_any_build(
    n: int, k: int, group: int, outliers: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The int8 kernel runs register tiles of up to 6 activation rows (2 on AVX2) × 64 weight rows (32),
    and smaller tiles for what is left; every tile sums each activation group exactly in int32 and
    takes the same float steps, so a row's output cannot depend on its batch's size nor on the
    build. 41 rows: 6 whole tiles and a ragged tail; N = 13, 24, 40 or 76 leaves part-filled slabs and units."""
    torch.manual_seed(n + k + group)
    w = torch.randn(n, k) * 0.05
    qw = quantize_int8(w, outliers=torch.tensor([3, k // 2 + 1]) if outliers else None)
    weights = cpu_kernels.Int8Weights(qw, group)
    x = torch.randn(41, k, dtype=torch.bfloat16)
    bias = torch.randn(n)
    outs = []
    for variant in [v for v in cpu_kernels.VARIANTS if cpu_kernels.supported(v)]:
        monkeypatch.setenv("SWITCHBOARD_CPU_KERNELS", variant)
        outs.append(cpu_kernels.int8_linear(x, weights, bias, out_dtype=torch.float32))
        outs.append(
            torch.cat(
                [cpu_kernels.int8_linear(x[i : i + 1], weights, bias, out_dtype=torch.float32) for i in range(41)]
            )
        )
        outs.append(
            torch.cat(
                [cpu_kernels.int8_linear(x[i : i + 7], weights, bias, out_dtype=torch.float32) for i in range(0, 41, 7)]
            )
        )
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    reference = x.float() @ qw.dequantize().T + bias
    assert (outs[0] - reference).norm() < 0.03 * reference.norm()


@pytest.mark.parametrize("rows", [1, 24])
def test_a_broken_int8_layout_fails_at_decode_and_prefill_sizes(rows: int) -> None:
    """The 16 rows of each slab in reverse, or the 4 inputs of each quad, must be caught by a decode row
    and by a prefill tile alike."""
    torch.manual_seed(7)
    n, k = 64, 576
    w = torch.randn(n, k) * 0.05
    x = torch.randn(rows, k)
    qw = quantize_int8(w)
    reference = x @ qw.dequantize().T
    good = cpu_kernels.Int8Weights(qw)
    assert (cpu_kernels.int8_linear(x, good, out_dtype=torch.float32) - reference).norm() < 0.03 * reference.norm()
    for dim in (2, 3):  # (slabs, quads, 16 rows, 4 inputs)
        broken = cpu_kernels.Int8Weights(qw)
        broken.packed = broken.packed.view(n // 16, k // 4, 16, 4).flip(dim).contiguous().view(-1)
        out = cpu_kernels.int8_linear(x, broken, out_dtype=torch.float32)
        assert (out - reference).norm() > 0.5 * reference.norm()
