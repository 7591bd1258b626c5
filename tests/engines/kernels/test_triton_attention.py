"""The Triton paged-attention kernels, run on the CPU by the Triton interpreter at tiny shapes.

The oracle is the torch backend on the same cache: `PagedKVCache.store` for `store_kv` (bit for bit,
int8 quantization included) and `TorchPagedAttention` for attention (decode-only and mixed batches: GQA
and not, block sizes 4 and 8, fp32/fp16 and int8 pools, shuffled block ids, stale data in unused slots).
bf16, which the interpreter cannot run, runs compiled on a CUDA device against the same CPU oracle.
Each kernel also runs broken on purpose (`triton_support.mutant`) to show its check catches the bug.
"""

from __future__ import annotations

import copy
import functools
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import triton_support

from engines.kernels import triton_attention as ta
from engines.kernels import triton_matmul, triton_moe
from engines.kernels import triton_store as ts
from engines.kernels.metadata import AttentionMetadata
from engines.kernels.quantize import quantize_int4
from engines.kernels.reference import TorchPagedAttention
from engines.kv.cache import PagedKVCache

DIM, BLOCKS = 16, 48
# Max error relative to the output's max magnitude. bf16: tests/test_gpu.py's for bf16 ops; the bf16 torch
# oracle alone is up to 0.009 off fp32 math on the same bf16 inputs here (the int8 pool's mixed batch).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# (tokens already cached, new tokens) per sequence, decodes first as the runner orders them. Contexts of
# 1..40 tokens; in the mixed batch, chunks from position 0 and mid-sequence, one longer than an extend
# tile (20 > 16), and a 3-token speculative verification.
BATCHES = {
    "decode": [(0, 1), (4, 1), (16, 1), (39, 1)],
    "mixed": [(3, 1), (0, 1), (25, 1), (0, 7), (12, 5), (6, 20), (33, 3)],
}
# (query heads, KV heads, block size, model dtype, int8 pool, decode splits); bf16 ones run on the GPU.
CONFIGS = {
    "gqa-bs4-fp32": (4, 2, 4, torch.float32, False, 4),
    "gqa3-bs8-fp16": (6, 2, 8, torch.float16, False, 8),
    "mha-bs8-int8-fp32": (2, 2, 8, torch.float32, True, 1),
    "gqa-bs4-int8-fp16": (4, 2, 4, torch.float16, True, 2),
    "gqa-bs4-bf16": (4, 2, 4, torch.bfloat16, False, 4),
    "gqa3-bs8-int8-bf16": (6, 2, 8, torch.bfloat16, True, 2),
}
# A split past a short row's end is empty: its log-sum-exp is log(0) = -inf on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")

Scenario = tuple[PagedKVCache, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]  # cache, q, k, v, meta


@functools.cache
def scenario(config: str, batch: str) -> Scenario:
    """A cache holding each sequence's cached prefix (stored by the torch backend), the step's q/k/v and
    its metadata. Callers copy the cache: both backends start from the same bits."""
    heads, kv_heads, block_size, dtype, int8, _ = CONFIGS[config]
    shapes = BATCHES[batch]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{config}/{batch}".encode()))
    cache = PagedKVCache(1, kv_heads, DIM, BLOCKS, block_size, dtype, torch.int8 if int8 else None)
    # Stale data of freed blocks everywhere: the kernels must mask it out.
    if int8:
        cache.buffer.copy_(torch.randint(-127, 128, cache.buffer.shape, generator=gen))
        cache.scales.copy_(torch.rand(cache.scales.shape, generator=gen))
    else:
        cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=gen) * 100)
    free = torch.randperm(BLOCKS, generator=gen).tolist()  # shuffled, non-contiguous block ids
    tables = [[free.pop() for _ in range(-(-(past + new) // block_size))] for past, new in shapes]
    for table, (past, _) in zip(tables, shapes, strict=True):
        if past:
            pos = torch.arange(past)
            slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
            k, v = (torch.randn(past, kv_heads, DIM, generator=gen).to(dtype) for _ in range(2))
            cache.store(0, slots, k * 2, v)
    meta = AttentionMetadata.build(block_size, tables, [p for p, _ in shapes], [n for _, n in shapes])
    tokens = sum(n for _, n in shapes)
    q = torch.randn(tokens, heads, DIM, generator=gen).to(dtype)
    k = (torch.randn(tokens, kv_heads, DIM, generator=gen) * 2).to(dtype)
    v = torch.randn(tokens, kv_heads, DIM, generator=gen).to(dtype)
    return cache, q, k, v, meta


# A sliding window shorter than most contexts (and than an extend tile, so a tile's later rows see none of its
# first keys) with its own score scale (Gemma 3's query_pre_attn_scalar): (window, scale).
WINDOWED = (5, 0.3)


@functools.cache
def expected(config: str, batch: str, windowed: bool = False) -> tuple[torch.Tensor, PagedKVCache]:
    cache, q, k, v, meta = scenario(config, batch)
    cache = copy.deepcopy(cache)
    window, scale = WINDOWED if windowed else (0, None)
    return TorchPagedAttention(cache).forward(0, q, k, v, meta, window=window, scale=scale), cache


def attention_error(
    config: str, batch: str, child: str | None = None, windowed: bool = False
) -> tuple[float, PagedKVCache]:
    """Max |Triton - torch| over the batch relative to the output's magnitude, and the Triton cache. bf16 runs
    the compiled kernels on the GPU in a child process (`triton_support.on_gpu`; `child` names another
    device for it); the oracle stays the CPU's."""
    cache, q, k, v, meta = scenario(config, batch)
    cache, splits = copy.deepcopy(cache), CONFIGS[config][5]
    if child := child or ("cuda" if CONFIGS[config][3] == torch.bfloat16 else None):
        out, cache = triton_support.on_gpu("attention", cache, splits, q, k, v, meta, device=child)
    else:
        window, scale = WINDOWED if windowed else (0, None)
        out = ta.TritonPagedAttention(cache, num_splits=splits).forward(0, q, k, v, meta, window=window, scale=scale)
    want, _ = expected(config, batch, windowed)
    assert out.dtype == q.dtype and out.shape == q.shape
    return ((out.double() - want.double()).abs().max() / want.abs().max()).item(), cache


def attention_passes(config: str, batch: str, windowed: bool = False) -> bool:
    error, _ = attention_error(config, batch, windowed=windowed)
    return error <= TOLERANCE[CONFIGS[config][3]]  # False for NaN too


def on_gpu_if_bf16(config: str, dtype: torch.dtype) -> object:
    return pytest.param(config, marks=triton_support.BF16_NEEDS_CUDA) if dtype == torch.bfloat16 else config


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("config", [on_gpu_if_bf16(name, c[3]) for name, c in CONFIGS.items()])
def test_attention_matches_torch_backend(config: str, batch: str) -> None:
    error, cache = attention_error(config, batch)
    assert error <= TOLERANCE[CONFIGS[config][3]], error
    _, want = expected(config, batch)
    assert torch.equal(cache.buffer, want.buffer)  # store_kv inside forward wrote the same bits
    assert cache.scales is None or torch.equal(cache.scales, want.scales)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("config", ["gqa-bs4-fp32", "gqa3-bs8-fp16", "gqa-bs4-int8-fp16"])
def test_windowed_attention_with_its_own_scale_matches_torch_backend(config: str, batch: str) -> None:
    error, _ = attention_error(config, batch, windowed=True)
    assert error <= TOLERANCE[CONFIGS[config][3]], error
    windowed, plain = expected(config, batch, True)[0], expected(config, batch)[0]
    assert not torch.allclose(windowed, plain)  # the window and scale change the answer: the oracles differ


# --- store_kv ------------------------------------------------------------------------------------------

STORE_CASES = {  # model dtype, pool dtype
    "fp32": (torch.float32, None),
    "fp16": (torch.float16, None),
    "bf16": (torch.bfloat16, None),  # a plain copy: runs under the interpreter
    "int8-fp32": (torch.float32, torch.int8),
    "int8-fp16": (torch.float16, torch.int8),
    "int8-bf16": (torch.bfloat16, torch.int8),  # bf16 scales (rounded to nearest even): on the GPU
}
STORE_ON_GPU = {"int8-bf16"}


def store_matches(case: str, child: str | None = None) -> bool:
    """store_kv against PagedKVCache.store, bit for bit over the whole pool (untouched slots included);
    bf16 scales on the GPU, in a child process (`child` names another device for it)."""
    dtype, kv_dtype = STORE_CASES[case]
    gen = torch.Generator().manual_seed(1)
    tokens, kv_heads, block_size, blocks = 7, 2, 4, 8
    ref = PagedKVCache(2, kv_heads, DIM, blocks, block_size, dtype, kv_dtype)
    ref.buffer.copy_(torch.randint(-100, 100, ref.buffer.shape, generator=gen))
    if ref.scales is not None:
        ref.scales.copy_(torch.rand(ref.scales.shape, generator=gen))
    mine = copy.deepcopy(ref)
    magnitude = torch.tensor([1e-3, 0.1, 1, 3, 50, 1, 1])[:, None, None]  # per token
    k, v = (torch.randn(tokens, kv_heads, DIM, generator=gen) * magnitude for _ in range(2))
    k[0, 0] = 0  # an all-zero vector: scale 0, divisor 1
    # absmax 127 makes the scale exactly 1, so x / scale lands on .5 ties: round half to even.
    k[1, 1] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 4.5, -4.5, 6.5, 0.25, -126.5, 5, 7.5, 9])
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    ref.store(1, slots, k, v)
    if child := child or ("cuda" if case in STORE_ON_GPU else None):
        mine = triton_support.on_gpu("store", mine, 1, slots, k, v, device=child)
    else:
        ts.store_kv(mine, 1, slots, k, v)
    return torch.equal(mine.buffer, ref.buffer) and (ref.scales is None or torch.equal(mine.scales, ref.scales))


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=triton_support.BF16_NEEDS_CUDA) if c in STORE_ON_GPU else c for c in STORE_CASES]
)
def test_store_kv_matches_cache_store(case: str) -> None:
    assert store_matches(case)


# --- The bf16 cases' trip to the GPU ------------------------------------------------------------------


def test_the_gpu_runner_gives_what_this_process_gets() -> None:
    """`triton_support.on_gpu`, which runs the bf16 cases compiled on a GPU, checked where there is none: its
    child process runs the same calls interpreted (device "cpu"), inputs and results pickled both ways, and
    must give what the kernels give here, bit for bit. Every runner, int8 pools and int4 weights included."""
    assert store_matches("int8-fp16", child="cpu")
    (here, cache), (there, their_cache) = (attention_error("gqa-bs4-int8-fp16", "mixed", c) for c in (None, "cpu"))
    assert here <= TOLERANCE[torch.float16] and there == here
    assert torch.equal(their_cache.buffer, cache.buffer) and torch.equal(their_cache.scales, cache.scales)
    gen = torch.Generator().manual_seed(5)
    qw, x, bias = quantize_int4(torch.randn(40, 64, generator=gen) * 0.1, 32), torch.randn(3, 64), torch.randn(40)
    matmul = ("int4", x, qw.q, qw.scales, qw.zeros, 32, bias)
    expected = triton_matmul.int4_weight_matmul(x, qw.q, qw.scales, qw.zeros, 32, bias)
    assert torch.equal(triton_support.on_gpu("matmul", *matmul, device="cpu"), expected)
    experts, hidden, inter, tokens = 4, 32, 16, 5
    w_gate_up, w_down = torch.randn(experts, 2 * inter, hidden) / 6, torch.randn(experts, hidden, inter) / 4
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
    moe = (torch.randn(tokens, hidden), w_gate_up, w_down, torch.rand(tokens, 2), ids)
    assert torch.equal(triton_support.on_gpu("moe", *moe, device="cpu"), triton_moe.fused_moe(*moe))


# --- Each kernel broken on purpose fails its check -----------------------------------------------------

MUTANTS: dict[str, tuple[str, str, str, Callable[[], bool]]] = {
    # id: (kernel, source, replaced by, the check that must now fail)
    "store-truncates": (
        "_store_vector",
        "q = _round_half_even(tl.math.div_rn(xf, divisor))",
        "q = tl.math.div_rn(xf, divisor)",
        lambda: store_matches("int8-fp32"),
    ),
    "store-rounds-half-up": (
        "_round_half_even",
        "(frac == 0.5) & odd",
        "(frac == 0.5)",
        lambda: store_matches("int8-fp32"),
    ),
    "store-divides-by-unrounded-scale": (
        "_store_vector",
        "divisor = scale.to(tl.float32)",
        "divisor = tl.math.div_rn(tl.max(tl.abs(xf), axis=0), 127.0)",
        lambda: store_matches("int8-fp16"),
    ),
    "decode-wrong-gqa-heads": (
        "_decode_split_kernel",
        "heads = kv_head * GROUP + offs_h",
        "heads = offs_h * tl.num_programs(1) + kv_head",
        lambda: attention_passes("gqa-bs4-fp32", "decode"),
    ),
    "decode-drops-last-position": (
        "_decode_split_kernel",
        "end = tl.minimum(start + per_split, length)",
        "end = tl.minimum(start + per_split, length - 1)",
        lambda: attention_passes("gqa-bs4-fp32", "decode"),
    ),
    "merge-skips-last-split": (
        "_decode_merge_kernel",
        "weight = tl.exp(lse - tl.max(lse, axis=0))",
        "weight = tl.where(offs_s < NUM_SPLITS - 1, tl.exp(lse - tl.max(lse, axis=0)), 0.0)",
        lambda: attention_passes("gqa-bs4-fp32", "decode"),
    ),
    "extend-causal-off-by-one": (
        "_attend_causal",
        "causal = (pos[None, :] <= q_pos[:, None])",
        "causal = (pos[None, :] < q_pos[:, None])",
        lambda: attention_passes("gqa3-bs8-fp16", "mixed"),
    ),
    "extend-wrong-gqa-heads": (
        "_extend_kernel",
        "heads = kv_head * GROUP + g",
        "heads = g * tl.num_programs(1) + kv_head",  # h % kv_heads instead of h // GROUP
        lambda: attention_passes("gqa3-bs8-fp16", "mixed"),
    ),
    "decode-drops-key-scale": (
        "_attend_block",
        "s = s * tl.load(ks_ptr + slot, mask=key_ok, other=0).to(tl.float32)[None, :]",
        "s = s * 1.0",
        lambda: attention_passes("mha-bs8-int8-fp32", "decode"),
    ),
    "decode-ignores-the-window": (
        "_decode_split_kernel",
        "lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)",
        "lo = 0",
        lambda: attention_passes("gqa-bs4-fp32", "decode", windowed=True),
    ),
    "extend-window-off-by-one": (
        "_attend_causal",
        "(pos[None, :] > q_pos[:, None] - window)",
        "(pos[None, :] >= q_pos[:, None] - window)",
        lambda: attention_passes("gqa3-bs8-fp16", "mixed", windowed=True),
    ),
    "extend-starts-past-the-first-rows-window": (
        "_attend_causal",
        "tl.min(q_pos, axis=0) - window + 1",
        "tl.max(q_pos, axis=0) - window + 1",
        lambda: attention_passes("gqa3-bs8-fp16", "mixed", windowed=True),
    ),
    "extend-drops-value-scale": (
        "_attend_block",
        "p = p * tl.load(vs_ptr + slot, mask=key_ok, other=0).to(tl.float32)[None, :]",
        "p = p * 1.0",
        lambda: attention_passes("gqa-bs4-int8-fp16", "mixed"),
    ),
}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN from a broken kernel
@pytest.mark.parametrize("name", list(MUTANTS))
def test_broken_kernel_fails_its_check(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel, old, new, check = MUTANTS[name]
    module = ts if hasattr(ts, kernel) else ta
    triton_support.poison_new_buffers(monkeypatch)
    assert check()  # the real kernel writes everything it reads back: NaN-filled buffers do not matter
    monkeypatch.setattr(module, kernel, triton_support.mutant(module, kernel, old, new))
    assert not check()


# --- The same kernels compile for the GPU ---------------------------------------------------------------

# Qwen2.5-1.5B's shapes (12 heads over 2 KV heads of 128), block size 16.
CONSTEXPRS = {
    "_store_kv_kernel": {"HEAD_DIM": 128},
    "_decode_split_kernel": {
        "GROUP": 6,
        "BLOCK_SIZE": 16,
        "NUM_SPLITS": 8,
        "BLOCK_H": 16,
        "BLOCK_N": 32,
        "HEAD_DIM": 128,
    },
    "_decode_merge_kernel": {"NUM_SPLITS": 8, "HEAD_DIM": 128},
    "_extend_kernel": {"GROUP": 6, "BLOCK_SIZE": 16, "BLOCK_M": 16, "BLOCK_G": 8, "BLOCK_N": 32, "HEAD_DIM": 128},
}


def compile_cases(dtype: str, int8: bool) -> list[tuple[str, dict[str, str], dict[str, object]]]:
    """(kernel, argument types, constexprs) for each kernel under a `dtype` model; ints are i32."""
    pool = "*i8" if int8 else f"*{dtype}"
    types = dict.fromkeys(["q_ptr", "out_ptr", "k_ptr", "v_ptr", "k_scales", "v_scales"], f"*{dtype}")
    types |= dict.fromkeys(["tables", "row_table", "row_len", "span_start", "span_new", "span_computed"], "*i32")
    types |= {"k_cache": pool, "v_cache": pool, "part_out": "*fp32", "part_lse": "*fp32", "slot_mapping": "*i64"}
    types["sm_scale"] = "fp32"
    quant = {"QUANT": int8}
    return [
        (name, types, consts if name == "_decode_merge_kernel" else consts | quant)
        for name, consts in CONSTEXPRS.items()
    ]


def test_kernels_compile_for_the_gpu(tmp_path: Path) -> None:
    """What the interpreter cannot show: every kernel lowers to an sm_90 (H100) cubin with Triton's own
    ptxas, for a bf16 model (which the interpreter cannot run) and an fp16 one over an int8 pool; and
    quantization divides with IEEE rounding there (div.rn, not div.full)."""
    cases = compile_cases("bf16", False) + compile_cases("fp16", True)
    ptx: dict[str, str] = {}
    for module in (ts, ta):
        mine = [case for case in cases if (ts if hasattr(ts, case[0]) else ta) is module]
        ptx_list = triton_support.compile_for_h100(module.__name__, mine, tmp_path)
        ptx |= dict(zip([f"{name}/{consts.get('QUANT')}" for name, _, consts in mine], ptx_list, strict=True))
    store = ptx["_store_kv_kernel/True"]
    assert "div.rn.f32" in store and "div.full" not in store and "cvt.rn.f16.f32" in store
