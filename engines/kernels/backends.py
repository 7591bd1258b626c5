"""Which implementation of each hot op runs, chosen in one place by where the tensors live.

Model code calls the functions below and never asks what device it is on. Three backends implement one
interface: `TorchBackend`, the reference (plain torch, any device; `engines.kernels.reference`);
`CpuBackend`, our C++ library's fused ops where it builds and the shapes fit (torch otherwise);
`TritonBackend`, fused Triton kernels on CUDA (paged attention, fused MoE, add + RMSNorm, RoPE, SiLU·mul,
weight-only int8/int4 matmuls). `backend_for(tensor)` picks by device type; `use(device_type, backend)`
swaps one in (benchmarks compare Triton with torch on one GPU; tests run the torch reference on the CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from engines.kernels import cpu_ops, reference
from engines.kernels.reference import MoELayer, TorchPagedAttention

if TYPE_CHECKING:
    from engines.kernels.metadata import AttentionBackend
    from engines.kernels.quantize import QuantizedWeight
    from engines.kv.cache import PagedKVCache

WeightKernel = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


class HeadShape(Protocol):
    """What picking an attention backend needs of a model's config (`engines.models.config.ModelConfig`)."""

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


class TorchBackend:
    """Plain torch: the reference every other backend is tested against."""

    name = "torch"

    def add_rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        offset: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(r), r) for r = residual + x (r = x without one); fp32 statistics, as HF transformers.
        `offset`: Gemma's (1 + w) scale, applied in fp32 before the cast back."""
        return reference.add_rms_norm(x, weight, eps, residual, offset)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q (tokens, q_heads·D) and k (tokens, k_heads·D) → (tokens, heads, D) each."""
        return reference.rotate(q, k, cos, sin, head_dim)

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        return reference.silu_mul(gate_up, intermediate)

    def gelu_tanh_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        return reference.gelu_tanh_mul(gate_up, intermediate)

    def attention(self, cache: PagedKVCache, cfg: HeadShape) -> AttentionBackend:
        return TorchPagedAttention(cache)

    def moe_experts(self, moe: MoELayer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Σ over each token's chosen experts of weight × expert(x), grouped by expert."""
        return reference.grouped_experts(moe, x, weights, ids)

    def weight_kernel(self, qw: QuantizedWeight, dtype: torch.dtype) -> WeightKernel | None:
        """A kernel for quantized weights on this backend; None: the `engines.layers.linear` CPU kernels."""
        return None


class CpuBackend(TorchBackend):
    """Our C++ library's fused ops (`engines.kernels.cpu_ops`) where it builds and the shapes fit."""

    name = "cpu"

    def add_rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        offset: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Gemma's offset form stays in torch here: our C++ norm has only the other rounding.
        if not offset and cpu_ops.usable(x, x.shape[-1]) and x.dim() == 2:  # updates `residual` in place
            return cpu_ops.add_rms_norm(x, weight, eps, residual)
        return super().add_rms_norm(x, weight, eps, residual, offset)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cpu_ops.usable(q, head_dim // 2) and q.stride(-1) == 1 and k.stride(-1) == 1 and q.stride(0) == k.stride(0):
            cpu_ops.rope_(q, k, cos, sin, head_dim)  # in place: q and k are views of the qkv output
            n = q.shape[0]
            return q.view(n, -1, head_dim), k.view(n, -1, head_dim)
        return super().rotate(q, k, cos, sin, head_dim)

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        if cpu_ops.usable(gate_up, intermediate):
            return cpu_ops.silu_mul(gate_up)
        return super().silu_mul(gate_up, intermediate)

    def attention(self, cache: PagedKVCache, cfg: HeadShape) -> AttentionBackend:
        from engines.kernels import cpu_attention

        if cpu_attention.supports(cache, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim):
            return cpu_attention.NativePagedAttention(cache)
        return super().attention(cache, cfg)


class TritonBackend(TorchBackend):
    """Fused Triton kernels (CUDA). The kernel modules import only here, on first use."""

    name = "triton"

    def add_rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        offset: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from engines.kernels import triton_norm

        if x.dim() != 2:
            return super().add_rms_norm(x, weight, eps, residual, offset)
        return triton_norm.add_rms_norm(x, weight, eps, residual, offset)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from engines.kernels import triton_rope

        if q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1:
            return triton_rope.rotate_(q, k, cos, sin, head_dim)  # in place, as the CPU path
        return super().rotate(q, k, cos, sin, head_dim)

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        from engines.kernels import triton_moe

        return triton_moe.silu_mul(gate_up, intermediate)

    def gelu_tanh_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        from engines.kernels import triton_moe

        return triton_moe.gelu_tanh_mul(gate_up, intermediate)

    def attention(self, cache: PagedKVCache, cfg: HeadShape) -> AttentionBackend:
        from engines.kernels.triton_attention import TritonPagedAttention

        return TritonPagedAttention(cache)

    def moe_experts(self, moe: MoELayer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from engines.kernels import triton_moe

        if any(e.gate_up_proj.weight is None for e in moe.experts):  # quantized experts: grouped path
            return super().moe_experts(moe, x, weights, ids)
        stacked = getattr(moe, "_triton_stacked", None)
        if stacked is None:  # built once; the experts' weights do not change while serving
            stacked = triton_moe.stacked_expert_weights(moe)
            moe._triton_stacked = stacked  # type: ignore[assignment]
        return triton_moe.fused_moe(x, *stacked, weights, ids)

    def weight_kernel(self, qw: QuantizedWeight, dtype: torch.dtype) -> WeightKernel | None:
        from engines.kernels import triton_matmul

        return triton_matmul.matmul_for(qw)


_BACKENDS: dict[str, TorchBackend] = {}


@functools.cache
def _default(device_type: str) -> TorchBackend:
    if device_type == "cpu":
        return CpuBackend()
    if device_type == "cuda" and _triton_available():
        return TritonBackend()
    return TorchBackend()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_for(x: torch.Tensor | torch.device | str) -> TorchBackend:
    """The backend for tensors on `x`'s device (a tensor, a device or a device type)."""
    kind = x.device.type if isinstance(x, torch.Tensor) else torch.device(x).type
    return _BACKENDS.get(kind) or _default(kind)


def use(device_type: str, backend: TorchBackend | None) -> None:
    """Serve `device_type` with `backend` from now on (None: the default again)."""
    if backend is None:
        _BACKENDS.pop(device_type, None)
    else:
        _BACKENDS[device_type] = backend
