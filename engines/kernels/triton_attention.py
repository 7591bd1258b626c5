"""Paged attention as Triton GPU kernels: the `AttentionBackend` for CUDA, same inputs as the torch one.

Four kernels, each a small Triton program over the pool of `engines.kv.cache.PagedKVCache`:

- `_store_kv_kernel` (`store_kv`, in `engines.kernels.triton_store`): writes each new token's key and value
  vectors into their slots first.
- `_decode_split_kernel` + `_decode_merge_kernel` (`paged_decode`): split-KV decode in two stages, the
  design of vLLM's `paged_attention_v2` and SGLang's two-stage `decode_attention`. Stage 1 runs one program
  per (row, KV head, split): it holds every query head of that KV head's group (GQA: the group's query
  rows share each key load and make one `tl.dot`, like SGLang's grouped decode kernel) and folds its share
  of the row's context into a partial (output, log-sum-exp) in fp32. Stage 2 merges a row's splits by
  log-sum-exp. Splits keep the GPU busy when a batch has few rows but long contexts.
- `_extend_kernel` (`extend_attention`): the multi-token rows of prefill chunks and speculative
  verification, like SGLang's `extend_attention`: one program per (span, KV head, tile of BLOCK_M query
  tokens × the heads of the group) walks key blocks up to the tile's last position with an online softmax,
  causal over the cached prefix plus the chunk itself (whose keys `store_kv` wrote first).

Blocks are read through `engines.kernels.metadata.RowTables` (flat block tables, where each row's table starts,
how many positions it sees): every length is read on the device, so the launch needs no host sync and the
same static buffers serve CUDA-graph replay. Keys are gathered per token (`slot = block * block_size +
offset`), so any block size works. With an int8 pool the int8 vectors are cast to the query dtype and
their scales fold in like `engines.kernels.reference._attend`: the key scale multiplies each score, the value
scale each probability. Softmax runs in fp32; fp32 dots ask for IEEE precision (not TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engines.kernels.metadata import AttentionMetadata
from engines.kernels.triton_store import check_head_dim, check_layout, store_kv
from engines.kv.cache import PagedKVCache

DECODE_SPLITS = 8  # stage-1 programs per (row, KV head); a power of two (stage 2 loads them as a vector)
DECODE_BLOCK_N = 32  # keys per step in decode
EXTEND_BLOCK_M = 16  # query tokens per extend tile (times the group's heads: the tile's rows)
EXTEND_BLOCK_N = 32  # keys per step in extend


# --- Attention: one online-softmax step, shared by decode and extend -----------------------------------


@triton.jit
def _attend_block(
    q: tl.tensor,  # (rows, HEAD_DIM) query rows, in the model dtype
    acc: tl.tensor,  # (rows, HEAD_DIM) fp32 running sum of probability-weighted values
    row_max: tl.tensor,  # (rows,) fp32 running max score
    row_sum: tl.tensor,  # (rows,) fp32 running sum of exp(score - row_max)
    slot: tl.tensor,  # (BLOCK_N,) int64 cache slots of this step's keys
    key_ok: tl.tensor,  # (BLOCK_N,) slots that exist (loads are masked by it)
    allowed: tl.tensor,  # (rows, BLOCK_N) which row sees which key
    k_ptr: tl.tensor,  # this KV head's keys / values / their scales
    v_ptr: tl.tensor,
    ks_ptr: tl.tensor,
    vs_ptr: tl.tensor,
    stride_cs: int,
    sm_scale: float,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Fold one block of keys into (acc, row_max, row_sum). A row that has allowed no key yet (a sliding
    window's later rows in a tile's first blocks) keeps acc = row_sum = 0: its max is taken as 0 for the
    exponentials, so they are exp(-inf) = 0, never exp(-inf - -inf) = nan."""
    offs = slot[:, None] * stride_cs + tl.arange(0, HEAD_DIM)[None, :]
    k = tl.load(k_ptr + offs, mask=key_ok[:, None], other=0)
    v = tl.load(v_ptr + offs, mask=key_ok[:, None], other=0)
    # int8 keys cast to the query dtype exactly (|x| <= 127); the scales apply to scores/probabilities.
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
    if QUANT:
        s = s * tl.load(ks_ptr + slot, mask=key_ok, other=0).to(tl.float32)[None, :]
    s = tl.where(allowed, s * sm_scale, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(s, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    alpha = tl.exp(row_max - safe_max)  # rescales what was summed under the old max
    p = tl.exp(s - safe_max[:, None])
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    if QUANT:
        p = p * tl.load(vs_ptr + slot, mask=key_ok, other=0).to(tl.float32)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
    return acc, new_max, row_sum


# --- Decode: split-KV, two stages ----------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
    q_ptr: tl.tensor,
    k_cache: tl.tensor,
    v_cache: tl.tensor,
    k_scales: tl.tensor,
    v_scales: tl.tensor,
    tables: tl.tensor,
    row_table: tl.tensor,
    row_len: tl.tensor,
    part_out: tl.tensor,  # (rows, heads, NUM_SPLITS, HEAD_DIM) fp32: each split's normalized output
    part_lse: tl.tensor,  # (rows, heads, NUM_SPLITS) fp32: each split's log-sum-exp (-inf if empty)
    sm_scale: float,
    window: int,  # > 0: the row sees its last `window` positions only
    num_heads: int,
    stride_qr: int,
    stride_qh: int,
    stride_ch: int,
    stride_cs: int,
    stride_sh: int,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)  # int64: offsets into a large pool can pass 2**31
    split = tl.program_id(2)
    # Each row's split length comes from its own length, on the device: no host sync, graph-replayable.
    length = tl.load(row_len + row)
    table = tables + tl.load(row_table + row)
    lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    per_split = tl.cdiv(length - lo, NUM_SPLITS)
    start = lo + split * per_split
    end = tl.minimum(start + per_split, length)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    head_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h  # GQA: query head h reads KV head h // GROUP
    q = tl.load(q_ptr + row * stride_qr + heads[:, None] * stride_qh + offs_d[None, :], mask=head_ok[:, None], other=0)

    acc = tl.zeros((BLOCK_H, HEAD_DIM), dtype=tl.float32)
    row_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for first in range(start, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        key_ok = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        acc, row_max, row_sum = _attend_block(
            q,
            acc,
            row_max,
            row_sum,
            slot,
            key_ok,
            key_ok[None, :],
            k_cache + kv_head * stride_ch,
            v_cache + kv_head * stride_ch,
            k_scales + kv_head * stride_sh,
            v_scales + kv_head * stride_sh,
            stride_cs,
            sm_scale,
            HEAD_DIM,
            QUANT,
        )
    # An empty split (short row) leaves row_sum = 0: it stores output 0 and lse -inf, which stage 2 weighs 0.
    index = (row * num_heads + heads) * NUM_SPLITS + split
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    tl.store(part_out + index[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None])
    tl.store(part_lse + index, row_max + tl.log(row_sum), mask=head_ok)


@triton.jit
def _decode_merge_kernel(
    part_out: tl.tensor,
    part_lse: tl.tensor,
    out_ptr: tl.tensor,
    num_heads: int,
    stride_or: int,
    stride_oh: int,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    index = (row * num_heads + head) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse + index)
    parts = tl.load(part_out + index[:, None] * HEAD_DIM + offs_d[None, :])
    # Split 0 is never empty (row_len >= 1), so the max is finite and empty splits weigh exp(-inf) = 0.
    weight = tl.exp(lse - tl.max(lse, axis=0))
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + row * stride_or + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    row_table: torch.Tensor,
    row_len: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    num_splits: int = DECODE_SPLITS,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """One query token per row: q (rows, heads, dim) over its row's context (its last `window` positions
    where window > 0) → (rows, heads, dim); scores scaled by `scale` (None: dim^-0.5).

    k/v_cache (kv_heads, blocks, block_size, dim) as `PagedKVCache.layer` returns them; `tables`,
    `row_table`, `row_len` as in `RowTables` (int32, row_len >= 1); `scales` for an int8 pool, each
    (kv_heads, blocks, block_size). Writes into `out` if given (any strides, head_dim contiguous)."""
    rows, heads, dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    if rows == 0:
        return out
    _check_queries(q, k_cache)
    check_layout(k_cache, v_cache, scales)
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    part_out = torch.empty(rows, heads, num_splits, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(rows, heads, num_splits, dtype=torch.float32, device=q.device)
    group = heads // kv_heads
    k_scales, v_scales = scales if scales is not None else (k_cache, v_cache)  # unused without QUANT
    _decode_split_kernel[(rows, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        tables,
        row_table,
        row_len,
        part_out,
        part_lse,
        dim**-0.5 if scale is None else scale,
        window,
        heads,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(2),
        k_scales.stride(0),
        GROUP=group,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)),  # a tensor-core-sized tile of query heads
        BLOCK_N=DECODE_BLOCK_N,
        HEAD_DIM=dim,
        QUANT=scales is not None,
    )
    _decode_merge_kernel[(rows, heads)](
        part_out, part_lse, out, heads, out.stride(0), out.stride(1), NUM_SPLITS=num_splits, HEAD_DIM=dim
    )
    return out


# --- Extend: causal chunks over the paged prefix -------------------------------------------------------


@triton.jit
def _attend_causal(
    q: tl.tensor,  # (ROWS, HEAD_DIM) query rows, in the model dtype
    q_pos: tl.tensor,  # (ROWS,) each row's position: it sees the keys at positions <= its own
    end: tl.tensor,  # keys [0, end) of the sequence are read
    table: tl.tensor,  # the sequence's block ids
    k_ptr: tl.tensor,  # this KV head's keys / values / their scales
    v_ptr: tl.tensor,
    ks_ptr: tl.tensor,
    vs_ptr: tl.tensor,
    stride_cs: int,
    sm_scale: float,
    window: int,
    ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """(acc, row_sum) of causal attention over the paged keys [0, end), BLOCK_N keys per `_attend_block`
    step: the output is acc / row_sum. `window` > 0: a row sees the keys in (its position - window, its
    position], and the loop starts at the first row's window."""
    acc = tl.zeros((ROWS, HEAD_DIM), dtype=tl.float32)
    row_max = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((ROWS,), dtype=tl.float32)
    lo = tl.where(window > 0, tl.maximum(tl.min(q_pos, axis=0) - window + 1, 0), 0)
    for first in range(lo, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        key_ok = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        causal = (pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
        causal = causal & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
        acc, row_max, row_sum = _attend_block(
            q,
            acc,
            row_max,
            row_sum,
            slot,
            key_ok,
            causal,
            k_ptr,
            v_ptr,
            ks_ptr,
            vs_ptr,
            stride_cs,
            sm_scale,
            HEAD_DIM,
            QUANT,
        )
    return acc, row_sum


@triton.jit
def _extend_kernel(
    q_ptr: tl.tensor,
    out_ptr: tl.tensor,
    k_cache: tl.tensor,
    v_cache: tl.tensor,
    k_scales: tl.tensor,
    v_scales: tl.tensor,
    tables: tl.tensor,
    row_table: tl.tensor,
    span_start: tl.tensor,  # (spans,) int32: the span's first row in q
    span_new: tl.tensor,  # (spans,) int32: its query tokens
    span_computed: tl.tensor,  # (spans,) int32: positions cached before it (its first position)
    sm_scale: float,
    window: int,
    stride_qr: int,
    stride_qh: int,
    stride_or: int,
    stride_oh: int,
    stride_ch: int,
    stride_cs: int,
    stride_sh: int,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
) -> None:
    span = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)  # int64: offsets into a large pool can pass 2**31
    tile = tl.program_id(2)
    num_new = tl.load(span_new + span)
    if tile * BLOCK_M >= num_new:  # the grid is sized for the longest span
        return
    first_row = tl.load(span_start + span)
    done = tl.load(span_computed + span)
    table = tables + tl.load(row_table + first_row)

    # The tile's rows: BLOCK_M tokens × BLOCK_G heads of this KV head's group, token-major.
    offs_r = tl.arange(0, BLOCK_M * BLOCK_G)
    token = tile * BLOCK_M + offs_r // BLOCK_G
    g = offs_r % BLOCK_G
    row_ok = (token < num_new) & (g < GROUP)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = first_row + token
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + rows[:, None] * stride_qr + heads[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0
    )
    # Padding rows (past the span) get a position at the tile's end: they see every key, never none.
    q_pos = done + token
    end = done + tl.minimum((tile + 1) * BLOCK_M, num_new)  # keys [0, end): up to the tile's last position

    acc, row_sum = _attend_causal(
        q,
        q_pos,
        end,
        table,
        k_cache + kv_head * stride_ch,
        v_cache + kv_head * stride_ch,
        k_scales + kv_head * stride_sh,
        v_scales + kv_head * stride_sh,
        stride_cs,
        sm_scale,
        window,
        BLOCK_M * BLOCK_G,
        BLOCK_SIZE,
        BLOCK_N,
        HEAD_DIM,
        QUANT,
    )
    out = acc / row_sum[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_or + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    row_table: torch.Tensor,
    span_start: torch.Tensor,
    span_new: torch.Tensor,
    span_computed: torch.Tensor,
    max_new: int,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Multi-token spans: rows [span_start[i], span_start[i] + span_new[i]) of q (tokens, heads, dim) are
    positions span_computed[i]... of one sequence, attending causally over its cached context (their own
    keys already stored; `window`, `scale` as `paged_decode`). `tables`/`row_table` as in `RowTables` (a
    span reads its first row's table); span_* int32 on q's device; `max_new` bounds span_new (sizes the
    grid without a sync). Rows outside the spans are left as they are in `out`."""
    heads, dim = q.shape[1:]
    kv_heads, _, block_size, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    if span_start.numel() == 0 or max_new == 0:
        return out
    _check_queries(q, k_cache)
    check_layout(k_cache, v_cache, scales)
    group = heads // kv_heads
    k_scales, v_scales = scales if scales is not None else (k_cache, v_cache)  # unused without QUANT
    grid = (span_start.numel(), kv_heads, triton.cdiv(max_new, EXTEND_BLOCK_M))
    _extend_kernel[grid](
        q,
        out,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        tables,
        row_table,
        span_start,
        span_new,
        span_computed,
        dim**-0.5 if scale is None else scale,
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(2),
        k_scales.stride(0),
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=EXTEND_BLOCK_M,
        BLOCK_G=triton.next_power_of_2(group),
        BLOCK_N=EXTEND_BLOCK_N,
        HEAD_DIM=dim,
        QUANT=scales is not None,
    )
    return out


def _check_queries(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    check_head_dim(q.shape[-1])
    assert q.stride(-1) == 1, "q needs contiguous head_dim"
    assert q.shape[1] % k_cache.shape[0] == 0, "query heads must be a multiple of KV heads"


# --- The backend ---------------------------------------------------------------------------------------


class TritonPagedAttention:
    """`AttentionBackend` on Triton kernels: store the new keys/values, decode rows, then extend spans."""

    def __init__(self, cache: PagedKVCache, num_splits: int = DECODE_SPLITS) -> None:
        self.cache = cache
        self.num_splits = num_splits

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        *,
        window: int = 0,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q (tokens, heads, dim), k/v (tokens, kv_heads, dim) → (tokens, heads, dim) in q's dtype; `window`
        and `scale` as `AttentionBackend.forward`."""
        device = q.device
        store_kv(self.cache, layer, meta.slot_mapping.to(device), k, v)
        k_cache, v_cache = self.cache.layer(layer)
        scales = self.cache.layer_scales(layer)
        tables, row_table = meta.rows.tables.to(device), meta.rows.row_table.to(device)
        out = torch.empty_like(q)
        decode = meta.num_decode
        if decode:
            row_len = meta.rows.row_len[:decode].to(device)
            paged_decode(
                q[:decode], k_cache, v_cache, tables, row_table[:decode], row_len, scales, out[:decode],
                self.num_splits, window, scale,
            )  # fmt: skip
        if meta.extends:
            start, new, computed = meta.extend_spans.to(device)
            max_new = max(s.num_new for s in meta.extends)
            extend_attention(
                q, k_cache, v_cache, tables, row_table, start, new, computed, max_new, scales, out, window, scale
            )
        return out
