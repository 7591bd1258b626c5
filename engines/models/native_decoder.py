"""Every decoder layer of a step in one call to our CPU library (`csrc/decoder.cpp`), where a model fits it.

The Python path makes ~10 library calls per layer, each ~6 µs of ctypes, allocation and checks: at
batch 1 that is a third of a SmolLM2 step. `sb_decoder` runs the same kernels in the same order on the
same buffers, so it computes the Python path's outputs to the bit (tests compare the two).

It takes a model when: the tensors are bf16 on the CPU, the library is loaded, every decoder layer is a
dense SwiGLU layer whose four linear layers run our int8 or int4 kernels, and the step's attention is
our native backend over a bf16 KV cache. `SWITCHBOARD_NATIVE_DECODER=0` turns it off (the tests'
comparison, and a way out).
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import torch

from engines.kernels import cpu_kernels, cpu_ops
from engines.kernels.cpu_attention import NativePagedAttention
from engines.layers.blocks import SwiGLU
from engines.layers.linear import Int4Kernel, Int8Kernel, Linear

if TYPE_CHECKING:
    from torch import nn

    from engines.kernels.metadata import AttentionBackend, AttentionMetadata
    from engines.layers.lora import LoraBatch

_p, _i, _f = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [
        ("format", _i), ("n", _i), ("k", _i), ("act_group", _i), ("n_out", _i),
        ("w", _p), ("scales", _p), ("neg_off", _p), ("out_idx", _p), ("outlier_w", _p), ("bias", _p),
    ]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("ln1", _p), ("ln2", _p), ("k_cache", _p), ("v_cache", _p),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("hidden", _i), ("heads", _i), ("kv_heads", _i), ("head_dim", _i), ("inter", _i),
        ("num_blocks", _i), ("block_size", _i), ("num_layers", _i), ("eps", _f), ("scale", _f),
    ]  # fmt: skip


class _LoraLinear(ctypes.Structure):
    _fields_ = [
        ("a", _p), ("ranks", _p), ("n_parts", _i), ("max_rank", _i), ("w_bf16", _i), ("part_group", _p),
        ("part_row", _p), ("part_cols", _p), ("part_col", _p), ("part_rank", _p), ("bt", _p),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("rows", _i), ("slots", _p), ("cos", _p), ("sin", _p), ("tables", _p), ("row_table", _p), ("row_len", _p),
        ("normed", _p), ("out_a", _p), ("out_b", _p), ("qkv", _p), ("attn", _p), ("gate_up", _p), ("act", _p),
        ("lora", _p), ("n_groups", _i), ("group_rows", _p), ("group_start", _p), ("lora_t", _p),
    ]  # fmt: skip


def _lora_linear(p: cpu_ops.LoraPlan) -> _LoraLinear:
    """A linear layer's `LoraPlan` as decoder.cpp's `LoraLinear`."""
    a, ranks = (ctypes.cast(x, _p) for x in (p.a, p.ranks))
    parts = (ctypes.cast(x, _p) for x in (p.part_group, p.part_row, p.part_cols, p.part_col, p.part_rank, p.bt))
    return _LoraLinear(a, ranks, p.n_parts, p.max_rank, int(p.bf16), *parts)


def enabled() -> bool:
    return os.environ.get("SWITCHBOARD_NATIVE_DECODER", "1") != "0"


def _linear(layer: Linear, keep: list[torch.Tensor]) -> _Linear | None:
    """The kernel's arguments for one linear layer, or None where it does not run our kernels."""
    kernel = layer.kernel
    if not isinstance(kernel, Int8Kernel | Int4Kernel) or kernel.native is None:
        return None
    bias = None
    if layer.bias is not None:
        bias = layer.bias.detach().float().contiguous()  # what `_gemm_operands` makes on every call
        keep.append(bias)
    w = kernel.native
    n, k = w.shape
    b = None if bias is None else bias.data_ptr()
    if isinstance(w, cpu_kernels.Int8Weights):
        n_out = 0 if w.outliers is None else w.outliers.numel()
        ptr = cpu_kernels._ptr
        return _Linear(
            1, n, k, w.act_group, n_out, w.packed.data_ptr(), w.scales.data_ptr(), w.neg_offset.data_ptr(),
            ptr(w.outliers), ptr(w.outlier_w), b,
        )  # fmt: skip
    return _Linear(2, n, k, 0, 0, w.packed.data_ptr(), None, None, None, None, b)


class NativeDecoder:
    """The model's decoder layers as one library call per step; `build` returns None where it cannot run."""

    def __init__(self, model: nn.Module, cache_layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cfg = model.config
        self.keep: list[torch.Tensor] = []
        layers = []
        for layer, (k_cache, v_cache) in zip(model.layers, cache_layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            parts = [_linear(lin, self.keep) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = [n.weight.detach().contiguous() for n in (layer.input_layernorm, layer.post_attention_layernorm)]
            self.keep += norms
            layers.append(_Layer(*parts, *(t.data_ptr() for t in norms), k_cache.data_ptr(), v_cache.data_ptr()))
        self.layers = (_Layer * len(layers))(*layers)
        # Each layer's qkv, o, gate_up, down, in the library's order: whose adapters a step's deltas read.
        self.linears = [
            lin
            for layer in model.layers
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        ]
        self._lora_args: dict[tuple[str, ...], tuple] = {}
        k0 = cache_layers[0][0]
        self.model = _Model(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
            k0.shape[1], k0.shape[2], len(layers), model.norm.eps, cfg.head_dim**-0.5,
        )  # fmt: skip

    @classmethod
    def build(cls, model: nn.Module, backend: AttentionBackend) -> NativeDecoder | None:
        """`model`: a `LlamaForCausalLM` (not imported: it imports this module)."""
        cfg = model.config
        if not enabled() or cpu_kernels.library() is None or not isinstance(backend, NativePagedAttention):
            return None
        cache = backend.cache
        if cache.quantized or cache.dtype != torch.bfloat16 or model.dtype != torch.bfloat16:
            return None
        if model.device.type != "cpu" or any(n % 8 for n in (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim)):
            return None
        for layer in model.layers:
            if not isinstance(layer.mlp, SwiGLU):
                return None
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if any(_linear(lin, []) is None for lin in linears):
                return None
            # One eps for every norm (the library takes one), bf16 weights (it reads them as such).
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if norm.eps != model.norm.eps or norm.weight.dtype != torch.bfloat16:
                    return None
        return cls(model, [cache.layer(i) for i in range(cfg.num_hidden_layers)])

    def supports(self, batch: LoraBatch | None) -> bool:
        """Whether this step's adapters (if any) run inside the call: each layer's deltas on our kernel."""
        return batch is None or all(lin.loras.native_for(batch) for lin in self.linears)

    def _lora(self, batch: LoraBatch) -> tuple[ctypes.Array, int]:
        """Every linear layer's kernel arguments for the step's adapters (kept per adapter set), and the
        largest rank of any (the scratch's row width)."""
        found = self._lora_args.get(batch.names)
        if found is None:
            plans = [lin.loras.plan(batch.names, lin.in_features) for lin in self.linears]
            args = [_lora_linear(p) for p in plans]
            found = ((_LoraLinear * len(args))(*args), max(p.max_rank for p in plans), plans)
            if len(self._lora_args) >= 4:  # the steady decode set and a joining prefill's, mostly
                self._lora_args.pop(next(iter(self._lora_args)))
            self._lora_args[batch.names] = found  # with its plans: alive while their pointers are in use
        return found[0], found[1]

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream): what the Python layers leave for the final
        norm. `hidden` (rows, hidden) bf16, the embeddings: it becomes the residual stream in place. `lora`:
        the step's adapters, each row's delta added after each linear layer as `Linear.forward` adds it."""
        lib = cpu_kernels.library()
        assert lib is not None
        m = self.model
        rows = hidden.shape[0]
        hidden = hidden.contiguous()
        q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim

        def buf(width: int) -> torch.Tensor:
            return torch.empty(rows, width, dtype=torch.bfloat16)

        out = [buf(m.hidden), buf(m.hidden)]
        work = [buf(m.hidden), *out, buf(q + 2 * kv), buf(q), buf(2 * m.inter), buf(m.inter)]
        cos, sin = (t.to(torch.bfloat16).contiguous() for t in rope)
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        r = meta.rows
        step = _Step(
            rows, slots.data_ptr(), cos.data_ptr(), sin.data_ptr(), r.tables.data_ptr(), r.row_table.data_ptr(),
            r.row_len.data_ptr(), *(t.data_ptr() for t in work),
        )  # fmt: skip
        if lora is not None and lora.names:
            args, max_rank = self._lora(lora)
            flat, starts = cpu_ops.lora_groups(list(lora.rows))
            scratch = torch.empty(flat.numel(), max_rank)
            step.lora, step.n_groups = ctypes.cast(args, _p), len(lora.names)
            step.group_rows, step.group_start = flat.data_ptr(), ctypes.cast(starts, _p)
            step.lora_t = scratch.data_ptr()
        last = lib.sb_decoder(ctypes.byref(m), self.layers, ctypes.byref(step), hidden.data_ptr())
        return out[last], hidden
