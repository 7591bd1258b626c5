"""The Triton RoPE (`engines.kernels.triton_rope`) and the dense SiLU·mul against the torch reference backend, on the
CPU under the Triton interpreter; each check is shown to catch a deliberately broken kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton_support  # before the kernel modules: it sets TRITON_INTERPRET before they are decorated

from engines.kernels import triton_moe, triton_rope
from engines.kernels.backends import TorchBackend
from engines.layers.blocks import RotaryEmbedding

TOLERANCE = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}


def qkv_views(
    tokens: int, q_heads: int, k_heads: int, head_dim: int, dtype: torch.dtype, shared: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv, q, k): q and k as the attention layer has them, column slices of one qkv projection output (v
    after k); or (`shared` off) in buffers of their own, where a head sent to the wrong one shows."""
    gen = torch.Generator().manual_seed(0)
    width = (q_heads + 2 * k_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen).to(dtype)
    q, k, _ = qkv.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
    return (qkv, q, k) if shared else (qkv, q.clone(), k.clone())


def check(tokens: int, q_heads: int, k_heads: int, head_dim: int, dtype: torch.dtype, shared: bool = True) -> None:
    qkv, q, k = qkv_views(tokens, q_heads, k_heads, head_dim, dtype, shared)
    rope = RotaryEmbedding(head_dim, 10000.0, 64)
    rope.build(dtype)
    cos, sin = rope(torch.arange(5, 5 + tokens) % 64)
    v_before = qkv[:, (q_heads + k_heads) * head_dim :].clone()
    expected_q, expected_k = TorchBackend().rotate(q.clone(), k.clone(), cos, sin, head_dim)
    out_q, out_k = triton_rope.rotate_(q, k, cos, sin, head_dim)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # rotated where they lie
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out_q, expected_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(out_k, expected_k, rtol=rtol, atol=atol)
    assert torch.equal(qkv[:, (q_heads + k_heads) * head_dim :], v_before)  # v untouched


def test_kernels_run_under_the_interpreter() -> None:
    assert triton_support.interpreted(triton_rope._rope_kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "k_heads", "head_dim"), [(4, 2, 16), (3, 1, 24), (2, 2, 8)])  # 24: masked half
@pytest.mark.parametrize("tokens", [1, 6])
def test_rope_matches_torch(tokens: int, q_heads: int, k_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    check(tokens, q_heads, k_heads, head_dim, dtype)
    check(tokens, q_heads, k_heads, head_dim, dtype, shared=False)


def test_no_tokens() -> None:
    _, q, k = qkv_views(0, 2, 1, 16, torch.float32)
    cos = sin = torch.empty(0, 1, 8)
    out_q, out_k = triton_rope.rotate_(q, k, cos, sin, 16)
    assert out_q.shape == (0, 2, 16) and out_k.shape == (0, 1, 16)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("a * cos - b * sin", "a * cos + b * sin"),  # the wrong rotation direction
        ("(head - NUM_Q_HEADS) * 2 * HALF", "(head - NUM_Q_HEADS) * HALF"),  # key heads half a head apart
        ("x2 = tl.load(x_ptr + HALF + offs", "x2 = tl.load(x_ptr + offs"),  # interleaved halves confused
        ("token * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)\n    sin", "offs, mask=mask, other=0.0)"
         ".to(tl.float32)\n    sin"),  # every token at position 0's angle
    ],
)  # fmt: skip
def test_broken_kernels_fail(monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    triton_support.poison_new_buffers(monkeypatch)
    monkeypatch.setattr(triton_rope, "_rope_kernel", triton_support.mutant(triton_rope, "_rope_kernel", old, new))
    with pytest.raises(AssertionError):
        check(6, 4, 2, 16, torch.float32, shared=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [24, 64])
def test_silu_mul_matches_torch(inter: int, dtype: torch.dtype) -> None:
    gate_up = torch.randn(2, 3, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype)
    expected = TorchBackend().silu_mul(gate_up, inter)
    out = triton_moe.silu_mul(gate_up, inter)
    assert out.shape == expected.shape == (2, 3, inter)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype][0], atol=TOLERANCE[dtype][1])


def test_kernel_compiles_for_the_gpu(tmp_path: Path) -> None:
    """The RoPE kernel lowers to sm_90 for bf16 at Qwen2.5-1.5B's heads (12 query, 2 key, 128 wide)."""
    types = dict.fromkeys(["q_ptr", "k_ptr", "cos_ptr", "sin_ptr"], "*bf16")
    cases = [("_rope_kernel", types, {"NUM_Q_HEADS": 12, "HALF": 64, "BLOCK": 64})]
    (ptx,) = triton_support.compile_for_h100("engines.kernels.triton_rope", cases, tmp_path)
    assert "cvt.rn.bf16.f32" in ptx  # rounded once, to nearest, from the fp32 products
