"""The native CPU kernels come in one build per instruction set (AVX2; AVX-512 VNNI; AMX, which is VNNI's plus
the int8 GEMM on tiles from 4 rows), picked once from the CPU's flags or forced by `SWITCHBOARD_CPU_KERNELS`;
every build computes the same numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.kernels import cpu_kernels
from engines.kernels.quantize import quantize_int4, quantize_int8
from tiny import tiny_hf_model

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the native kernels are off on this machine")
VNNI = pytest.mark.skipif(not cpu_kernels.supported("avx512-vnni"), reason="this CPU has no AVX-512 VNNI")
AMX = pytest.mark.skipif(not cpu_kernels.supported("amx"), reason="this CPU has no AMX (amx_tile, amx_int8)")


def test_the_build_follows_the_cpu_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWITCHBOARD_CPU_KERNELS", raising=False)
    flags = cpu_kernels.cpu_flags()
    widest = "avx512-vnni" if {"avx512_vnni", "avx512vl", "avx512bw"} <= flags else "avx2"
    widest = "amx" if widest == "avx512-vnni" and {"amx_tile", "amx_int8"} <= flags else widest
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
    for variant in [v for v in cpu_kernels.VARIANTS if cpu_kernels.supported(v)]:
        monkeypatch.setenv("SWITCHBOARD_CPU_KERNELS", variant)
        assert cpu_kernels.variant() == variant
        out[variant], dequantized = linear(fmt, x, w)
    assert all(torch.equal(out["avx2"], o) for o in out.values())
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


@AMX
def test_the_amx_build_gets_the_tiles() -> None:
    """Linux grants the tile state on request (once per process); without it the build would run its VNNI loops
    and say so, so `amx` here means the tiles are in use."""
    lib = cpu_kernels.build_of("amx")
    assert lib is not None and cpu_kernels.NAMES[lib.sb_variant()] == "amx"
    assert lib.sb_amx() == 1


def test_a_build_the_cpu_cannot_run_falls_back_to_a_narrower_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced `amx` on a CPU without AMX (or VNNI) loads the widest build the CPU runs, never an instruction
    it lacks."""
    flags = cpu_kernels.cpu_flags() - {"amx_tile", "amx_int8", "amx_bf16"}
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    cpu_kernels.build_of.cache_clear()
    try:
        lib = cpu_kernels.build_of("amx")
        assert lib is not None
        expected = "avx512-vnni" if cpu_kernels.CPU_FLAGS_FOR["avx512-vnni"] <= flags else "avx2"
        assert cpu_kernels.NAMES[lib.sb_variant()] == expected
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags - {"avx512_vnni"})
        cpu_kernels.build_of.cache_clear()
        assert cpu_kernels.NAMES[cpu_kernels.build_of("amx").sb_variant()] == "avx2"
    finally:
        cpu_kernels.build_of.cache_clear()


@AMX
@pytest.mark.parametrize("rows", [7, 8, 9, 16, 17, 33])  # below the tiles (int8: 8 rows, int4: 9), one tile, 2, 3
@pytest.mark.parametrize(("n", "k", "group"), [(48, 1536, 256), (40, 544, 256), (16, 352, 96), (24, 8960, 256)])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_amx_matches_the_vector_loops_to_the_bit(
    fmt: str, rows: int, n: int, k: int, group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiles compute the vector loops' exact group sums. int8: 1536 inputs are 6 whole 256-input groups;
    544 leaves a last group of 32 (half a tile step, zero-padded), 96-input groups are a step and a half each;
    8960 inputs are the down projection's. N = 40 leaves a half-filled unit, N = 16 one slab, 24 a slab and a
    half. int4 (groups of 32: one tile product each) on the same shapes."""
    torch.manual_seed(rows * n + k)
    w = torch.randn(n, k) * 0.05
    if fmt == "int8":
        qw = quantize_int8(w, outliers=torch.tensor([5, k - 3]))
        weights: object = cpu_kernels.Int8Weights(qw, group)
        kernel = cpu_kernels.int8_linear
    else:
        qw = quantize_int4(w)
        weights, kernel = cpu_kernels.Int4Weights(qw), cpu_kernels.int4_linear
    x = torch.randn(rows, k, dtype=torch.bfloat16) * 3
    bias = torch.randn(n)
    outs = {}
    for variant in ("avx2", "avx512-vnni", "amx"):
        monkeypatch.setenv("SWITCHBOARD_CPU_KERNELS", variant)
        outs[variant] = kernel(x, weights, bias, out_dtype=torch.float32)
    assert torch.equal(outs["amx"], outs["avx512-vnni"]) and torch.equal(outs["amx"], outs["avx2"])
    reference = x.float() @ qw.dequantize().T + bias
    assert (outs["amx"] - reference).norm() < 0.03 * reference.norm()
