"""The torch reference of every hot op: what `engines.kernels.backends.TorchBackend` runs, and what the
fused CPU and Triton kernels are tested against. Plain torch on any device; nothing here imports the
model code (`engines.layers`, `engines.models`), which calls these through its device's backend.

Attention (`TorchPagedAttention`). Computed as two batched matmuls around an fp32 softmax, with the query
heads that share a KV head folded into that head's query rows (GQA without copying keys). Two reasons:
- Speed: a decode query is a few rows; fused CPU SDPA packs the keys for every (sequence, head) pair
  and ran 2.5x slower at 32 sequences. Accuracy matches it (top-1 agreement with fp32: 96.2% vs 96.4%
  over 391 SmolLM2 positions), as the scores are rounded to bf16 like HF's eager attention.
- Batch invariance: every row of a bf16 matmul here is bit-identical whatever the number of rows or
  batch entries, and masked key slots (widths padded to multiples of 16) add exact zeros. So a token's
  output does not depend on what shares its step, how its prompt was chunked, or whether its prefix
  came from the cache: greedy answers do not change with server load.

An int8 pool (see `engines.kv.cache`) is read without dequantizing it: the gathered int8 blocks are
cast to the query dtype (exact, |x| ≤ 127), each key's scale multiplies its score column before the
softmax and each value's scale its probability column before the second matmul; that is attention
over the dequantized keys and values. Every step is per row or elementwise, so batch invariance holds.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engines.kernels.metadata import WIDTH_MULTIPLE, AttentionMetadata, DecodeGroup, ExtendSpan
from engines.kv.cache import PagedKVCache

EXTEND_ROWS = 128  # query tokens per matmul in a chunk: each block reads keys only up to its own end


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(r), r) for r = residual + x (r = x without one); fp32 statistics, as HF transformers. `offset`:
    Gemma's form (HF's `Gemma3RMSNorm`), which scales by (1 + w) in fp32 and rounds once at the end; the
    others round the normalized row to the activations' dtype and then multiply by w."""
    r = x if residual is None else residual + x
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(r.dtype), r
    return weight * h.to(r.dtype), r


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE (HF's `rotate_half`) on (..., head_dim) with (..., head_dim/2) tables."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q (tokens, q_heads·D) and k (tokens, k_heads·D) → (tokens, heads, D) each."""
    n = q.shape[0]
    return apply_rotary(q.view(n, -1, head_dim), cos, sin), apply_rotary(k.view(n, -1, head_dim), cos, sin)


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    gate, up = gate_up.split(intermediate, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """GELU (tanh approximation, HF's `gelu_pytorch_tanh`) of the gate times up: Gemma's GeGLU."""
    gate, up = gate_up.split(intermediate, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class MoELayer(Protocol):
    """What the MoE kernels need of a sparse MoE layer (`engines.models.moe.SparseMoE`)."""

    num_experts: int
    top_k: int
    experts: torch.nn.ModuleList  # SwiGLU experts: gate_up_proj and down_proj linears

    def run_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor: ...


def grouped_experts(moe: MoELayer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Σ over each token's chosen experts of weight × expert(x): the (token, expert) pairs sorted by expert,
    each expert run once on all of its tokens, results added back into their rows (the torch path)."""
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    tokens = order // moe.top_k
    scale = weights.flatten()[order].unsqueeze(1)
    start = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=moe.num_experts).tolist()):
        if not count:
            continue
        rows = tokens[start : start + count]
        y = moe.run_expert(expert, x[rows]) * scale[start : start + count]
        out.index_add_(0, rows, y)
        start += count
    return out


class TorchPagedAttention:
    """Pure-torch paged attention: gathers each sequence's blocks, then matmul, softmax, matmul."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

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
        """q (tokens, heads, dim), k/v (tokens, kv_heads, dim) → (tokens, heads, dim). `window` > 0: each
        query sees its own position and the `window - 1` before it; `scale`: the scores' (None: dim^-0.5)."""
        self.cache.store(layer, meta.slot_mapping, k, v)
        k_cache, v_cache = self.cache.layer(layer)
        scales = self.cache.layer_scales(layer)
        if len(meta.decode_groups) == 1 and not meta.extends:
            return self.forward_decode(q, k_cache, v_cache, meta.decode_groups[0], scales, window, scale)
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            rows = slice(group.start, group.end)
            out[rows] = self.forward_decode(q[rows], k_cache, v_cache, group, scales, window, scale)
        for span in meta.extends:
            rows = slice(span.start, span.start + span.num_new)
            out[rows] = self.forward_extend(q[rows], k_cache, v_cache, span, scales, window, scale)
        return out

    def forward_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: DecodeGroup,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        window: int = 0,
        scale: float | None = None,
    ) -> torch.Tensor:
        """One query per sequence, batched: (b, heads, dim) → (b, heads, dim). With an int8 cache,
        `scales` are its key and value scales, each (kv_heads, blocks, block_size)."""
        tables, mask = group.block_tables, group.mask
        if window:  # the mask allows positions <= each row's own; drop those `window` or more behind it
            last = mask.sum(-1, keepdim=True) - 1
            mask = mask & (torch.arange(mask.shape[-1], device=mask.device) > last - window)
        b, blocks = tables.shape
        kv_heads, _, bs, dim = k_cache.shape
        flat = tables.view(-1)
        # Heads lead: (kv_heads, b, width, dim) straight from the gather, so the matmuls need no copy.
        keys = k_cache.index_select(1, flat).view(kv_heads, b, blocks * bs, dim)
        values = v_cache.index_select(1, flat).view(kv_heads, b, blocks * bs, dim)
        if scales is not None:  # int8: each gathered vector's scale, (kv_heads, b, width)
            k_scales, v_scales = scales
            scales = (
                k_scales.index_select(1, flat).view(kv_heads, b, blocks * bs),
                v_scales.index_select(1, flat).view(kv_heads, b, blocks * bs),
            )
        group = q.shape[1] // kv_heads
        folded = q.view(b, kv_heads, group, dim).transpose(0, 1)
        out = _attend(folded, keys, values, mask.view(1, b, 1, -1), scales, scale)
        return out.transpose(0, 1).reshape(b, kv_heads * group, dim)

    def forward_extend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        span: ExtendSpan,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        window: int = 0,
        scale: float | None = None,
    ) -> torch.Tensor:
        """One sequence's chunk against its whole context: (n, heads, dim) → (n, heads, dim)."""
        n, heads, dim = q.shape
        kv_heads = k_cache.shape[0]
        group = heads // kv_heads
        keys = k_cache.index_select(1, span.block_ids).view(kv_heads, -1, dim)
        values = v_cache.index_select(1, span.block_ids).view(kv_heads, -1, dim)
        if scales is not None:  # int8: each gathered vector's scale, (kv_heads, width)
            k_scales, v_scales = scales
            scales = (
                k_scales.index_select(1, span.block_ids).view(kv_heads, -1),
                v_scales.index_select(1, span.block_ids).view(kv_heads, -1),
            )
        folded = q.view(n, kv_heads, group, dim).permute(1, 0, 2, 3)  # (kv_heads, n, group, dim)
        out = torch.empty(kv_heads, n, group, dim, dtype=q.dtype, device=q.device)
        for lo in range(0, n, EXTEND_ROWS):  # causal: a block of rows needs keys up to its end only
            hi = min(n, lo + EXTEND_ROWS)
            first, last = span.num_computed + lo, span.num_computed + hi  # positions [first, last)
            width = -(-last // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
            rows = folded[:, lo:hi].reshape(kv_heads, (hi - lo) * group, dim)
            ahead = torch.arange(first, last, device=q.device).repeat_interleave(group).unsqueeze(1)
            allowed = torch.arange(width, device=q.device) <= ahead
            if window:
                allowed &= torch.arange(width, device=q.device) > ahead - window
            cut = None if scales is None else (scales[0][:, :width], scales[1][:, :width])
            block = _attend(rows, keys[:, :width], values[:, :width], allowed, cut, scale)
            out[:, lo:hi] = block.view(kv_heads, hi - lo, group, dim)
        return out.permute(1, 0, 2, 3).reshape(n, heads, dim)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ · scale, masked) v over (..., rows, dim) × (..., keys, dim); fp32 softmax; scale
    defaults to 1/√d.

    With `scales` = (k_scales, v_scales), each (..., keys), k and v are int8 standing for k * k_scales
    and v * v_scales: the key scales multiply the score columns, the value scales the probabilities."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if scales is None:
        scores = torch.matmul(q, k.transpose(-1, -2)).float()
        scores.mul_(scale).masked_fill_(~allowed, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    k_scales, v_scales = scales
    scores = torch.matmul(q, k.to(q.dtype).transpose(-1, -2)).float()
    scores.mul_(k_scales.unsqueeze(-2).float()).mul_(scale).masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).mul_(v_scales.unsqueeze(-2).float())
    return torch.matmul(probs.to(q.dtype), v.to(q.dtype))
