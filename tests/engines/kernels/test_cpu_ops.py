"""Fused decoder ops (`engines.kernels.cpu_ops`, `engines.kernels.cpu_attention`) against the torch code they
replace and against a plain fp32 attention written out here; each check is shown to catch a broken input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.kernels import cpu_kernels, cpu_ops
from engines.kernels.cpu_attention import NativePagedAttention
from engines.kernels.metadata import AttentionMetadata
from engines.kernels.reference import TorchPagedAttention, apply_rotary
from engines.kv.cache import PagedKVCache

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs an AVX2 CPU and a C++ compiler")

DTYPES = [torch.float32, torch.bfloat16]


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest difference in units of the last place (bf16 or fp32 bit patterns of same-sign values)."""
    view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return int((a.view(view).int() - b.view(view).int()).abs().max())


def torch_norm(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = r.float()
    return (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(r.dtype)).detach()


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight = (torch.rand(576) + 0.5).to(dtype)
    x, residual = torch.randn(6, 576).to(dtype), (torch.randn(6, 576) * 4).to(dtype)
    expected_r = residual + x
    out, r = cpu_ops.add_rms_norm(x, weight, 1e-5, residual)
    assert r is residual and torch.equal(r, expected_r)  # the residual add is one rounding, in place
    # The mean of squares is summed in another order (and 1/sqrt for rsqrt): the last place or so.
    close = 1 if dtype == torch.bfloat16 else 8
    assert ulps(out, torch_norm(expected_r, weight, 1e-5)) <= close
    plain, same = cpu_ops.add_rms_norm(x, weight, 1e-5, None)
    assert same is x and ulps(plain, torch_norm(x, weight, 1e-5)) <= close
    wrong, _ = cpu_ops.add_rms_norm(x, weight.flip(0), 1e-5, None)  # a misplaced weight is caught
    assert ulps(wrong, plain) > close


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_is_bit_identical_to_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    n, heads, kv_heads, dim = 5, 6, 2, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim).to(dtype)
    angles = torch.rand(n, 1, dim // 2) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q = apply_rotary(q.reshape(n, heads, dim), cos, sin)
    want_k = apply_rotary(k.reshape(n, kv_heads, dim), cos, sin)
    cpu_ops.rope_(q, k, cos, sin, dim)
    assert torch.equal(q.reshape(n, heads, dim), want_q)
    assert torch.equal(k.reshape(n, kv_heads, dim), want_k)
    swapped = qkv.clone()
    cpu_ops.rope_(swapped[:, : heads * dim], swapped[:, heads * dim : (heads + kv_heads) * dim], sin, cos, dim)
    assert not torch.equal(swapped[:, : heads * dim].reshape(n, heads, dim), apply_rotary(want_q, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    gate_up = (torch.randn(7, 2 * 1536) * 4).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    expected = F.silu(gate) * up
    assert ulps(cpu_ops.silu_mul(gate_up), expected) <= (1 if dtype == torch.bfloat16 else 8)
    assert ulps(cpu_ops.silu_mul(gate_up.roll(1, dims=1)), expected) > 8


def reference_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], rows: list[tuple[int, int]]
) -> torch.Tensor:
    """Plain fp32 attention: row t (of sequence s) attends to the first `length` keys of s."""
    out = []
    for t, (s, length) in enumerate(rows):
        k, v = keys[s][:length].float(), values[s][:length].float()  # (L, kv_heads, D)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t].float(), k) * q.shape[-1] ** -0.5
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def fill(dtype: torch.dtype, kv: torch.dtype | None, heads: int = 6, kv_heads: int = 2, dim: int = 64):  # noqa: ANN201
    """A cache holding three sequences' history, and a step mixing one decode with two prefill chunks."""
    torch.manual_seed(3)
    bs = 16
    cache = PagedKVCache(1, kv_heads, dim, 12, bs, dtype, kv)
    cache.buffer.zero_()
    if cache.scales is not None:
        cache.scales.zero_()
    tables, done, new = [[3, 7, 1], [2, 4], [5, 9, 0, 11]], [30, 0, 17], [1, 20, 25]
    history = AttentionMetadata.build(bs, [tables[0], tables[2]], [0, 0], [30, 17])
    old_k, old_v = torch.randn(47, kv_heads, dim).to(dtype), torch.randn(47, kv_heads, dim).to(dtype)
    cache.store(0, history.slot_mapping, old_k, old_v)
    meta = AttentionMetadata.build(bs, tables, done, new)
    n = sum(new)
    q = torch.randn(n, heads, dim).to(dtype)
    k, v = torch.randn(n, kv_heads, dim).to(dtype), torch.randn(n, kv_heads, dim).to(dtype)
    # What each sequence's context holds once this step's keys are stored (int8: as stored).
    keys = [torch.cat((old_k[:30], k[:1])), k[1:21], torch.cat((old_k[30:], k[21:]))]
    values = [torch.cat((old_v[:30], v[:1])), v[1:21], torch.cat((old_v[30:], v[21:]))]
    rows = [(0, 31)] + [(1, i + 1) for i in range(20)] + [(2, 17 + i + 1) for i in range(25)]
    return cache, meta, (q, k, v), keys, values, rows


@pytest.mark.parametrize("kv", [None, torch.int8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (12, 2), (4, 4)])  # query heads per KV head: 3, 6, 1
def test_paged_attention_matches_plain_attention(
    dtype: torch.dtype, kv: torch.dtype | None, heads: int, kv_heads: int
) -> None:
    """Groups of 1 and 6 query heads run the value sum's unrolled register loops, 3 the general one."""
    cache, meta, (q, k, v), keys, values, rows = fill(dtype, kv, heads, kv_heads)
    out = NativePagedAttention(cache).forward(0, q, k, v, meta)
    if kv is not None:  # the reference sees the keys and values as the int8 cache holds them
        from engines.kv.cache import quantize

        keys = [(lambda c, s: c.float() * s.float()[..., None])(*quantize(x, dtype)) for x in keys]
        values = [(lambda c, s: c.float() * s.float()[..., None])(*quantize(x, dtype)) for x in values]
    expected = reference_attention(q, keys, values, rows)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
    assert ((out.float() - expected).norm() / expected.norm()).item() < tolerance
    # The torch backend agrees (it rounds scores and probabilities to bf16 in bf16).
    torch_out = TorchPagedAttention(cache).forward(0, q, k, v, meta)
    assert ((out.float() - torch_out.float()).norm() / expected.norm()).item() < (
        1e-5 if dtype == torch.float32 else 1e-2
    )
    # A row that saw one position too many is caught.
    bad = meta.rows.row_len.clone()
    bad[5] += 1
    wrong = cpu_ops.paged_attention(
        q, *cache.layer(0), cache.layer_scales(0), meta.rows.tables, meta.rows.row_table, bad
    )
    assert (wrong[5].float() - expected[5]).norm() / expected[5].norm() > 10 * tolerance


def test_paged_attention_rows_do_not_depend_on_their_batch() -> None:
    cache, meta, (q, k, v), *_ = fill(torch.bfloat16, None)
    native = NativePagedAttention(cache)
    together = native.forward(0, q, k, v, meta)
    rows = meta.rows
    for t in (0, 7, 20, 45):  # a decode row, prefill rows: each alone gives the same bits
        alone = cpu_ops.paged_attention(
            q[t : t + 1], *cache.layer(0), None, rows.tables, rows.row_table[t : t + 1], rows.row_len[t : t + 1]
        )
        assert torch.equal(alone[0], together[t])
