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
