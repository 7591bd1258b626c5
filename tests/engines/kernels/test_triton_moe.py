"""The fused-MoE Triton kernels (`engines.kernels.triton_moe`) under the interpreter, against `SparseMoE.forward`.

Tiny shapes (H 32, I 16/24, E 4, k 2) keep the interpreter fast; T = 1 leaves experts unused (no tiles for
them), T = 40 gives an expert several tiles, I = 24 leaves a partial K tile in the down GEMM. Each kernel
has mutants showing the comparison catches a broken kernel. bf16, which the interpreter cannot run, runs
compiled on a CUDA device against the same CPU oracle.
"""

from __future__ import annotations

import triton_support  # isort: skip  (first: it sets TRITON_INTERPRET before the kernel module is imported)

from pathlib import Path

import pytest
import torch

from engines.kernels import triton_moe
from engines.kernels.quantize import quantize
from engines.models.config import ModelConfig, MoEConfig
from engines.models.moe import SparseMoE

H, E, K = 32, 4, 2
# Max error relative to the output's max magnitude; bf16: fp16's for three fewer mantissa bits (8x the rounding).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2.4e-2}


def tiny_moe(inter: int, *, shared: int = 0, seed: int = 0) -> SparseMoE:
    """A random-weight SparseMoE: Mixtral-style (renormalised top-k), or Qwen2-MoE with a shared expert."""
    cfg = ModelConfig(
        architecture="Qwen2MoeForCausalLM" if shared else "MixtralForCausalLM",
        vocab_size=16,
        hidden_size=H,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=False,
        moe=MoEConfig(
            num_experts=E,
            num_experts_per_tok=K,
            moe_intermediate_size=inter,
            shared_expert_intermediate_size=shared,
            norm_topk_prob=False,
        ),
    )
    moe = SparseMoE(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return moe


def experts_only(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The oracle: SparseMoE.forward less its shared expert (which fused_moe does not compute)."""
    out = moe(x)
    if moe.shared_expert is not None:
        shared = moe.shared_expert(x)
        if moe.shared_expert_gate is not None:
            shared = torch.sigmoid(moe.shared_expert_gate(x)) * shared
        out = out - shared
    return out


def rel_err(moe: SparseMoE, x: torch.Tensor) -> float:
    """Max |fused - SparseMoE| relative to the output's magnitude. bf16 runs the compiled kernels on the GPU
    (`triton_support.on_gpu`) with the routing the CPU oracle took: a near tie routed apart there would be no
    kernel error."""
    with torch.no_grad():
        ref = experts_only(moe, x)
        args = (x, *triton_moe.stacked_expert_weights(moe), *moe.route(x))
        gpu = x.dtype == torch.bfloat16
        out = triton_support.on_gpu("moe", *args) if gpu else triton_moe.fused_moe(*args)
    assert out.shape == ref.shape and out.dtype == x.dtype
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def inputs(tokens: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_kernels_run_under_the_interpreter() -> None:
    assert triton_support.interpreted(triton_moe._grouped_gemm_kernel)
    assert triton_support.interpreted(triton_moe._silu_mul_kernel)


@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("tokens", [1, 5, 13])
def test_align_by_expert(tokens: int, block_m: int) -> None:
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K] for t in range(tokens)])
    sentinel = tokens * K
    pairs, expert_of_block, used_rows = triton_moe.align_by_expert(ids, E, block_m)
    assert pairs.dtype == expert_of_block.dtype == used_rows.dtype == torch.int32
    bound = triton_moe.max_padded(tokens * K, E, block_m)
    assert pairs.shape == (bound,) and expert_of_block.shape == (bound // block_m,)  # shapes alone fix them
    num_padded = int(used_rows.item())
    assert num_padded % block_m == 0 and num_padded <= bound
    assert (pairs[num_padded:] == sentinel).all()  # past the real rows: padding only
    expert_of_block = expert_of_block[: num_padded // block_m]
    pairs = pairs[:num_padded]
    real = pairs[pairs != sentinel]
    assert sorted(real.tolist()) == list(range(sentinel))  # every pair exactly once
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=E)
    # Just enough padding: each used expert rounds up to a tile, an unused one gets none.
    assert num_padded == sum(-(-c // block_m) * block_m for c in counts.tolist())
    assert expert_of_block.tolist() == sorted(expert_of_block.tolist())
    for b, expert in enumerate(expert_of_block.tolist()):
        tile = pairs[b * block_m : (b + 1) * block_m]
        tile_real = tile[tile != sentinel]
        assert len(tile_real) > 0 and (flat[tile_real.long()] == expert).all()  # one expert per tile
        assert (tile[: len(tile_real)] != sentinel).all()  # padding only after the expert's pairs
        assert tile_real.tolist() == sorted(tile_real.tolist())  # stable: in token order
    if tokens == 1:
        assert set(expert_of_block.tolist()) == set(ids.flatten().tolist())  # unused experts: no tiles


def test_align_by_expert_bound_is_tight() -> None:
    # Every pair on its own expert: each pads a whole tile, exactly the bound.
    ids = torch.arange(E).view(-1, K)
    pairs, _, used_rows = triton_moe.align_by_expert(ids, E, 16)
    assert int(used_rows.item()) == pairs.numel() == E * 16


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=triton_support.BF16_NEEDS_CUDA)],
    ids=["fp32", "fp16", "bf16"],
)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 16), (5, 24), (13, 16), (40, 16)])
def test_fused_moe_matches_sparse_moe(tokens: int, inter: int, dtype: torch.dtype) -> None:
    moe = tiny_moe(inter).to(dtype)
    x = inputs(tokens, dtype)
    used = torch.unique(moe.route(x)[1])
    if tokens == 1:
        assert len(used) < E  # some expert has no tiles at all
    if tokens == 40:  # 80 pairs: some expert spans several BLOCK_M tiles
        assert torch.bincount(moe.route(x)[1].flatten()).max() > triton_moe.BLOCK_M
    assert rel_err(moe, x) < TOLERANCE[dtype]


def test_fused_moe_with_shared_expert_and_unnormalised_weights() -> None:
    # Qwen2-MoE with norm_topk_prob off: routing weights do not sum to 1, so a dropped weight would show.
    moe = tiny_moe(16, shared=32, seed=2)
    assert rel_err(moe, inputs(7, torch.float32, seed=3)) < 1e-5


def test_no_tokens() -> None:
    moe = tiny_moe(16)
    x = inputs(0, torch.float32)
    out = triton_moe.fused_moe(x, *triton_moe.stacked_expert_weights(moe), *moe.route(x))
    assert out.shape == (0, H)


def test_stacked_expert_weights_layout_and_quantized_experts() -> None:
    moe = tiny_moe(16)
    w_gate_up, w_down = triton_moe.stacked_expert_weights(moe)
    assert w_gate_up.shape == (E, 32, H) and w_down.shape == (E, H, 16)
    assert torch.equal(w_gate_up[2], moe.experts[2].gate_up_proj.weight)
    assert torch.equal(w_down[3], moe.experts[3].down_proj.weight)
    lin = moe.experts[1].gate_up_proj  # K = H = 32: a shape the int8 kernels take
    lin.set_quantized(quantize(lin.weight.detach(), "int8"), torch.float32)
    with pytest.raises(ValueError, match="quantized"):
        triton_moe.stacked_expert_weights(moe)


GEMM_MUTANTS = {
    "routing weight not applied": ("acc = acc * scale[:, None]", "acc = acc"),
    "every tile reads expert 0": ("expert * stride_we", "0 * stride_we"),
    "token row = pair % k": ("rows = pairs // ROWS_PER_A", "rows = pairs % ROWS_PER_A"),
    "last K tile dropped": ("range(0, tl.cdiv(K, BLOCK_K))", "range(0, K // BLOCK_K)"),
    "last real tile skipped": ("BLOCK_M >= tl.load(num_padded_ptr)", "BLOCK_M >= tl.load(num_padded_ptr) - BLOCK_M"),
}
SILU_MUTANTS = {
    "no silu": ("act = gate * tl.sigmoid(gate) * up", "act = gate * up"),
    "up read from the gate half": ("row * stride_gm + inter + offs", "row * stride_gm + offs"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gelu_tanh_mul_matches_the_reference(dtype: torch.dtype) -> None:
    """Gemma's GeGLU activation: the kernel's GELU-tanh (tanh as 2·sigmoid(2y) - 1) against torch's."""
    from engines.kernels.reference import gelu_tanh_mul

    gate_up = (torch.randn(7, 2 * 40, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    want = gelu_tanh_mul(gate_up.float(), 40)
    got = triton_moe.gelu_tanh_mul(gate_up, 40)
    assert got.dtype == dtype
    torch.testing.assert_close(
        got.float(), want, rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-5 if dtype == torch.float32 else 2e-3
    )
    silu = triton_moe.silu_mul(gate_up, 40)
    assert not torch.allclose(silu.float(), want, atol=1e-2)  # a kernel that ignored GELU would fail above


GELU_MUTANTS = {
    "gelu without the cubic term": ("gate + 0.044715 * gate * gate * gate", "gate"),
    "gelu without the half": ("act = 0.5 * gate * (2.0", "act = gate * (2.0"),
}


@pytest.mark.parametrize("name", list(GELU_MUTANTS))
def test_broken_gelu_fails(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        triton_moe, "_silu_mul_kernel", triton_support.mutant(triton_moe, "_silu_mul_kernel", *GELU_MUTANTS[name])
    )
    with pytest.raises(AssertionError):
        test_gelu_tanh_mul_matches_the_reference(torch.float32)


@pytest.mark.parametrize(("name", "kernel", "edit"), [
    *((name, "_grouped_gemm_kernel", edit) for name, edit in GEMM_MUTANTS.items()),
    *((name, "_silu_mul_kernel", edit) for name, edit in SILU_MUTANTS.items()),
])  # fmt: skip
def test_broken_kernels_fail(name: str, kernel: str, edit: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # T = 5 (every gathered row stays in bounds for the pair % k mutant); I = 24: a partial K tile in GEMM 2.
    moe, x = tiny_moe(24, shared=32, seed=2), inputs(5, torch.float32, seed=3)
    triton_support.poison_new_buffers(monkeypatch)
    assert rel_err(moe, x) < 1e-5
    monkeypatch.setattr(triton_moe, kernel, triton_support.mutant(triton_moe, kernel, *edit))
    assert not rel_err(moe, x) <= 1e-2, name  # NaN (rows left unwritten) fails the check too


def test_kernels_compile_for_the_gpu(tmp_path: Path) -> None:
    """Both kernels lower to sm_90 for bf16 experts at Qwen1.5-MoE's shapes (hidden 2048, 1408 per expert),
    and the grouped GEMM's dots become tensor-core MMAs."""
    gemm = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "scale_ptr": "*bf16"}
    gemm |= {"sorted_pairs_ptr": "*i32", "expert_of_block_ptr": "*i32", "num_padded_ptr": "*i32"}
    tiles = {"PRECISION": "tf32", "BLOCK_M": triton_moe.BLOCK_M, "BLOCK_N": 64, "BLOCK_K": 64}
    cases = [
        ("_grouped_gemm_kernel", gemm, {"ROWS_PER_A": 4, "APPLY_SCALE": False} | tiles),
        ("_grouped_gemm_kernel", gemm, {"ROWS_PER_A": 1, "APPLY_SCALE": True} | tiles),
        ("_silu_mul_kernel", {"gate_up_ptr": "*bf16", "out_ptr": "*bf16"}, {"BLOCK": 1024}),
    ]
    ptx = triton_support.compile_for_h100("engines.kernels.triton_moe", cases, tmp_path)
    assert all("mma" in p for p in ptx[:2]), "the grouped GEMM did not lower to tensor-core MMAs"
