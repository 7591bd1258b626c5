"""The int8 KV cache: quantization error, attention over int8 blocks, and an engine serving from it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

import engines.kernels.reference as attention
from engines.engine import Engine, EngineConfig
from engines.kernels.metadata import AttentionMetadata
from engines.kernels.reference import TorchPagedAttention
from engines.kv.cache import PagedKVCache, bytes_per_block, bytes_per_token, quantize
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from tiny import tiny_hf_model

HEADS, KV_HEADS, DIM, BS = 6, 2, 64, 4


def test_quantize_round_trip_error_is_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, KV_HEADS, DIM, generator=gen) * torch.logspace(-4, 3, 50)[:, None, None]
    x[7, 1] = 0  # an all-zero vector: scale 0, no NaN
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        q, scale = quantize(xd, dtype)
        assert q.dtype == torch.int8 and scale.dtype == dtype and scale.shape == (50, KV_HEADS)
        assert q[7, 1].eq(0).all() and scale[7, 1] == 0
        err = (q.float() * scale.float().unsqueeze(-1) - xd.float()).abs().amax(-1)
        amax = xd.float().abs().amax(-1)
        assert (err <= scale.float() * 0.5001).all()  # rounded to the nearest step of the stored scale
        assert (err <= amax / 254 * 1.01).all()  # at most ~0.4% of the vector's largest entry
        assert q.abs().amax(-1)[amax > 0].ge(126).all()  # and the whole int8 range is used


def test_store_writes_int8_values_and_scales_through_the_slots() -> None:
    cache = PagedKVCache(2, KV_HEADS, DIM, 8, BS, torch.bfloat16, torch.int8)
    assert cache.buffer.dtype == torch.int8 and cache.scales is not None
    assert cache.scales.shape == (2, 2, KV_HEADS, 8, BS) and cache.scales.dtype == torch.bfloat16
    cache.zero_blocks(list(range(8)))
    k, v = torch.randn(2, 3, KV_HEADS, DIM).bfloat16()
    slots = torch.tensor([5, 0, 30])
    cache.store(1, slots, k, v)
    for which, x in enumerate((k, v)):
        q, s = quantize(x, torch.bfloat16)
        for i, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, BS)
            assert torch.equal(cache.buffer[1, which, :, block, offset], q[i])
            assert torch.equal(cache.scales[1, which, :, block, offset], s[i])
    assert cache.buffer[0].eq(0).all() and cache.scales[0].eq(0).all()  # other layers untouched
    cache.zero_blocks([1])
    assert cache.buffer[:, :, :, 1].eq(0).all() and cache.scales[:, :, :, 1].eq(0).all()


def test_bytes_per_token_counts_the_scales() -> None:
    bf16, f32, i8 = torch.bfloat16, torch.float32, torch.int8
    assert bytes_per_token(30, 3, 64, bf16) == 2 * 30 * 3 * 64 * 2  # SmolLM2-135M: 23,040
    assert bytes_per_token(30, 3, 64, bf16, i8) == 2 * 30 * 3 * (64 + 2)  # 11,880: 0.516x
    assert bytes_per_token(28, 2, 128, bf16, i8) / bytes_per_token(28, 2, 128, bf16) == 130 / 256  # Qwen2.5-1.5B
    assert bytes_per_token(3, 2, 16, f32, i8) == 2 * 3 * 2 * (16 + 4)  # fp32 models keep fp32 scales
    assert bytes_per_block(30, 3, 64, 16, bf16, i8) == 16 * bytes_per_token(30, 3, 64, bf16, i8)
    assert PagedKVCache(30, 3, 64, 10, 16, bf16, i8).nbytes == 10 * bytes_per_block(30, 3, 64, 16, bf16, i8)


# --- attention over int8 blocks ----------------------------------------------------------------------


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """q (new, heads, dim) against k/v (past + new, kv_heads, dim), causal, computed naively in fp64."""
    group = HEADS // KV_HEADS
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / DIM**0.5
    allowed = torch.arange(k.shape[0])[None, :] <= (past + torch.arange(q.shape[0]))[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def mixed_batch_errors(dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[float, float]:
    """Largest error of paged attention over a batch of two decode groups and three chunks, against
    fp64 attention over (the original keys and values, the keys and values the pool holds)."""
    gen = torch.Generator().manual_seed(0)
    # (cached, new): short decodes, long decodes (a second group), then chunks, one past EXTEND_ROWS
    shapes = [(p, 1) for p in (0, 3, 6, 9, 11, 13, 200, 207, 214, 221, 228, 235)] + [(0, 7), (12, 5), (9, 140)]
    num_blocks = sum(-(-(p + n) // BS) for p, n in shapes) + 8
    cache = PagedKVCache(1, KV_HEADS, DIM, num_blocks, BS, dtype, kv_dtype)
    if cache.scales is None:
        cache.buffer.normal_(0, 1e4, generator=gen)  # stale data of freed blocks: must be masked out
    else:
        cache.buffer.random_(-127, 128, generator=gen)
        cache.scales.uniform_(0, 100, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-(p + n) // BS))] for p, n in shapes]
    full_k = [torch.randn(p + n, KV_HEADS, DIM, generator=gen).to(dtype) for p, n in shapes]
    full_v = [torch.randn(p + n, KV_HEADS, DIM, generator=gen).to(dtype) for p, n in shapes]
    q = [torch.randn(n, HEADS, DIM, generator=gen).to(dtype) for _, n in shapes]
    backend = TorchPagedAttention(cache)
    earlier = AttentionMetadata.build(
        BS, tables, [0] * len(shapes), [p for p, _ in shapes]
    )  # what earlier steps stored
    cache.store(
        0,
        earlier.slot_mapping,
        torch.cat([k[:p] for k, (p, _) in zip(full_k, shapes, strict=True)]),
        torch.cat([v[:p] for v, (p, _) in zip(full_v, shapes, strict=True)]),
    )
    meta = AttentionMetadata.build(BS, tables, [p for p, _ in shapes], [n for _, n in shapes])
    assert len(meta.decode_groups) == 2 and len(meta.extends) == 3
    new_k = torch.cat([k[p:] for k, (p, _) in zip(full_k, shapes, strict=True)])
    new_v = torch.cat([v[p:] for v, (p, _) in zip(full_v, shapes, strict=True)])
    out = backend.forward(0, torch.cat(q), new_k, new_v, meta)
    assert out.dtype == dtype and out.isfinite().all()

    def held(x: torch.Tensor) -> torch.Tensor:
        if cache.scales is None:
            return x
        values, scales = quantize(x, dtype)
        return values.double() * scales.double().unsqueeze(-1)

    to_original = to_held = 0.0
    row = 0
    for qi, k, v, (past, new) in zip(q, full_k, full_v, shapes, strict=True):
        got = out[row : row + new].double()
        to_original = max(to_original, (got - reference(qi, k, v, past)).abs().max().item())
        to_held = max(to_held, (got - reference(qi, held(k), held(v), past)).abs().max().item())
        row += new
    return to_original, to_held


def ignoring_scale(which: int) -> Callable[..., torch.Tensor]:
    """`_attend` with the key (0) or value (1) scales replaced by ones: a broken int8 read."""
    real = attention._attend

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        allowed: torch.Tensor,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        if scales is not None:
            ones = torch.ones_like(scales[which])
            scales = (ones, scales[1]) if which == 0 else (scales[0], ones)
        return real(q, k, v, allowed, scales, scale)

    return attend


@pytest.mark.parametrize(("dtype", "exact_tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_int8_attention_matches_full_precision_attention(
    dtype: torch.dtype, exact_tol: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the model-dtype pool both errors are the same thing: rounding of the attention itself.
    full, _ = mixed_batch_errors(dtype, dtype)
    to_original, to_held = mixed_batch_errors(dtype, torch.int8)
    assert full < exact_tol
    assert to_held < exact_tol  # it is attention over the dequantized keys and values ...
    assert to_original < 0.05  # ... which is close to attention over the originals (unit-variance data)
    for which in (0, 1):  # and a read that ignores the key or the value scales fails both checks
        monkeypatch.setattr(attention, "_attend", ignoring_scale(which))
        broken_original, broken_held = mixed_batch_errors(dtype, torch.int8)
        assert broken_original > 1.0 and broken_held > 1.0
        monkeypatch.undo()


# --- an engine serving from an int8 pool ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"), head_dim=64)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(1, 320, (45,), generator=gen).tolist()  # two prompts share a 45-token prefix
    own = [torch.randint(1, 320, (n,), generator=gen).tolist() for n in (5, 17, 40, 63, 90, 120, 9, 33)]
    return [*own, shared + own[0], shared + own[1]]


def engine(tiny_dir: Path, dtype: str, kv_cache_dtype: str, kv_cache_bytes: int = 1 << 22) -> Engine:
    config = EngineConfig(
        block_size=BS, kv_cache_bytes=kv_cache_bytes, max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype
    )
    return Engine.from_dir(tiny_dir, dtype=dtype, config=config)


def serve(engine: Engine, batch: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    """Greedy outputs of `batch`, all submitted at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(batch):
        engine.add_request(EngineRequest(str(i), prompt, params))
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
    assert engine.stats().kv_blocks_used == 0
    return [outs[str(i)] for i in range(len(batch))]


def test_int8_pool_holds_about_twice_the_blocks(tiny_dir: Path) -> None:
    budget = 1 << 22
    full, int8 = engine(tiny_dir, "bf16", "auto", budget), engine(tiny_dir, "bf16", "int8", budget)
    assert full.block_manager.num_blocks == budget // bytes_per_block(3, 2, 64, BS, torch.bfloat16)
    assert int8.block_manager.num_blocks == budget // bytes_per_block(3, 2, 64, BS, torch.bfloat16, torch.int8)
    assert 1.9 < int8.block_manager.num_blocks / full.block_manager.num_blocks < 128 / 66 + 0.01
    assert full.stats().kv_cache_bytes <= budget and budget - int8.stats().kv_cache_bytes < bytes_per_block(
        3, 2, 64, BS, torch.bfloat16, torch.int8
    )
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine(tiny_dir, "bf16", "fp8")


def test_int8_engine_greedy_agrees_with_the_full_precision_pool(tiny_dir: Path) -> None:
    # fp32 weights, so the only difference is the pool; a random tiny model's logits are close together,
    # so a near tie may still flip and a flip changes the rest of that answer: most tokens, not all.
    batch = prompts()
    full = serve(engine(tiny_dir, "fp32", "auto"), batch)
    int8 = serve(engine(tiny_dir, "fp32", "int8"), batch)
    same = sum(a == b for f, i in zip(full, int8, strict=True) for a, b in zip(f, i, strict=True))
    assert same >= 0.8 * sum(map(len, full))
    assert sum(f[0] == i[0] for f, i in zip(full, int8, strict=True)) >= len(batch) - 1  # first tokens: prefill


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_int8_engine_batched_greedy_equals_one_at_a_time(tiny_dir: Path, dtype: str) -> None:
    # Each vector is quantized alone, so a token's stored bits, and then its outputs, do not depend on
    # what shares its step, how its prompt is chunked (32-token steps) or whether its prefix was cached.
    int8, batch = engine(tiny_dir, dtype, "int8"), prompts()
    alone = [serve(int8, [p])[0] for p in batch]
    hits = int8.stats().prefix_hit_tokens
    assert serve(int8, batch) == alone
    assert int8.stats().prefix_hit_tokens > hits


def test_tier_setting_reaches_the_engine_config() -> None:
    from core.settings import Settings, TierSettings
    from gateway.runtime.tiers import engine_config

    assert engine_config(TierSettings()).kv_cache_dtype == "auto"
    settings = Settings(tiers={"small": {"kv_cache_dtype": "int8"}})
    assert engine_config(settings.tiers["small"]).kv_cache_dtype == "int8"
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        TierSettings(kv_cache_dtype="fp8")  # type: ignore[arg-type]
