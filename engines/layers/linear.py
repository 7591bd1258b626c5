"""Linear layers whose weights are prepared once, after loading, for the fastest kernel at hand.

bf16 on the CPU: oneDNN's prepacked weight layout runs 1.3-2× faster than `F.linear` on the plain
matrix at the batch sizes we serve (measured: 576→3072 at M=1 122 µs vs 188 µs, 1536→8960 1.16 ms vs
1.47 ms, 2 threads), and gives identical results up to M=16. It needs AVX-512 (or AVX-NE-CONVERT); other
CPUs and dtypes use `F.linear`. The
packed copy replaces the plain weight, so memory does not double; a weight shared with the embedding
keeps its plain copy there.

Quantized (`engines.kernels.quantize` formats): decode reads every weight once per step, so fewer bytes per
weight is speed. Where our AVX2 kernels build (`engines.kernels.cpu_kernels`), int4 layers and uncalibrated
int8 layers run them: integer dot products against each token's activations quantized in groups of 32,
streaming the weight at close to memory speed. Elsewhere int4 runs torch's weight-only kernel
(`_weight_int4pack_mm_for_cpu`) and int8 torch's `_weight_int8pack_mm`. Calibrated int8 layers (the
int8 tier) run int8×int8 with per-token activations on fbgemm (`Int8Kernel`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engines.kernels import cpu_kernels
from engines.kernels.backends import backend_for
from engines.kernels.quantize import QuantizedWeight
from engines.layers.lora import LayerAdapters, active_batch


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _mkldnn_bf16()
    )


@functools.cache
def _mkldnn_bf16() -> bool:
    """oneDNN's packed bf16 path needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on AVX2-only CPUs it raises."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Int8Kernel:
    format = "int8"
    """Per-channel int8 weights.

    Where our kernels build: `engines.kernels.cpu_kernels.int8_linear` at every batch size, int8×int8 with
    activations quantized per 256 inputs and, for calibrated layers, the outlier input channels kept
    out of the int8 activations and added in fp32 (LLM.int8()'s decomposition with fixed channels: a
    few channels run 100x the rest, and quantized with them SmolLM2 lost 3.9% perplexity). Each row is
    computed alone, so results do not depend on the batch.

    Elsewhere, torch's: calibrated layers run fbgemm's packed dynamic linear. fbgemm quantizes
    activations over the whole tensor's [min, max], so each row is scaled to unit max and two extra
    input columns holding +1 and -1 (zero weights) pin that range to [-1, 1]: per-token quantization in
    effect. On CPUs without VNNI its u8×s8 pair sums saturate, so activations get 7 bits there, which
    cost SmolLM2 +1.8% perplexity against +0.6% for ours on an AVX2 EPYC. Uncalibrated layers use the
    weight-only `_weight_int8pack_mm`.
    """

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.outliers = qw.outliers
        self.nbytes = qw.q.numel() + qw.scales.numel() * 4
        self.native = cpu_kernels.Int8Weights(qw) if cpu_kernels.available() else None
        if self.native is not None:
            self.nbytes = self.native.nbytes
            return
        self.scales = qw.scales.to(dtype)  # the weight-only kernel wants the activation dtype
        self.packed = None
        if qw.outliers is not None and _has_fbgemm():
            zeros = torch.zeros(qw.q.shape[0], dtype=torch.long)
            padded = torch.nn.functional.pad(qw.q, (0, 2))  # the two range-pinning columns
            with warnings.catch_warnings():  # quantized tensors are deprecated, still the way into fbgemm
                warnings.simplefilter("ignore", UserWarning)
                w = torch._make_per_channel_quantized_tensor(padded, qw.scales.double(), zeros, 0)
                self.packed = torch.ops.quantized.linear_prepack(w, None)
        # (k, N) fp32: the outlier columns of the dequantized weight, transposed for addmm.
        self.outlier_w = None
        if qw.outliers is not None:
            self.outlier_w = (qw.q[:, qw.outliers].float() * qw.scales.float()[:, None]).T.contiguous()
        self.q = None if self.packed is not None else qw.q.contiguous()
        if self.q is not None and self.q.data_ptr() % 64:  # `_weight_int8pack_mm` crashes on misaligned weights
            self.q = self.q.clone()
        self.scales32 = qw.scales.float()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.native is not None:
            return cpu_kernels.int8_linear(x, self.native, bias, out_dtype=self.dtype)
        return self._compute(x) if bias is None else self._compute(x) + bias

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        if self.outliers is None:
            return torch._weight_int8pack_mm(x.contiguous(), self.q, self.scales)
        xf = x.float()
        side = xf[:, self.outliers]
        xf = xf.index_fill(1, self.outliers, 0.0)
        if self.packed is None:  # no fbgemm (e.g. an ARM build): `_int_mm` with per-row scales
            xq, xs = quantize_rows(xf)
            out = torch._int_mm(xq, self.q.T).float().mul_(xs).mul_(self.scales32)
        else:
            unit = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
            pinned = torch.cat((xf.div_(unit), _PIN.expand(xf.shape[0], 2)), dim=1)
            out = torch.ops.quantized.linear_dynamic(pinned, self.packed, _REDUCE_RANGE).mul_(unit)
        return out.addmm_(side, self.outlier_w).to(self.dtype)


_PIN = torch.tensor([[1.0, -1.0]])


# Without VNNI, fbgemm multiplies u8 activations by s8 weights with vpmaddubsw, whose int16 pair sums
# saturate (255·127·2 > 32767): on an AVX2 EPYC, 3.3% error on the ordinary channels instead of <2%.
# Seven-bit activations (reduce_range) cannot saturate; with AVX-512 VNNI the full 8 bits are safe.
# (Our kernel's activations are 7-bit with +64, so its pairs reach at most 2·127·127: never saturating.)
_REDUCE_RANGE = "avx512_vnni" not in cpu_kernels.cpu_flags()


def _has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int4Kernel:
    format = "int4"
    """Group-wise int4 weights: our kernel where it builds, else torch's `_weight_int4pack_mm_for_cpu`
    (which dequantizes to float in the activation dtype: ~3x slower at one row here)."""

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype) -> None:
        assert qw.zeros is not None
        self.dtype = dtype
        self.group_size = qw.group_size
        self.native = cpu_kernels.Int4Weights(qw) if cpu_kernels.available() else None
        if self.native is not None:
            self.nbytes = self.native.nbytes
            return
        self.packed = torch._convert_weight_to_int4pack_for_cpu(qw.unpacked(), 8)
        # (K/group, N, 2): scale and zero of each group, in the activation dtype as the kernel wants.
        self.scale_zeros = torch.stack((qw.scales.T, qw.zeros.T), dim=-1).contiguous().to(dtype)
        self.nbytes = self.packed.numel() + self.scale_zeros.numel() * self.scale_zeros.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.native is not None:
            return cpu_kernels.int4_linear(x, self.native, bias, out_dtype=self.dtype)
        out = torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size, self.scale_zeros)
        return out if bias is None else out + bias


class BackendKernel:
    """A device backend's kernel for quantized weights (on CUDA: Triton's weight-only matmuls)."""

    native = None  # not our CPU library

    def __init__(self, qw: QuantizedWeight, run: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> None:
        self.format, self.nbytes, self.run = qw.format, qw.nbytes, run

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.run(x, bias)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row (token): (codes (M, K) int8, scales (M, 1) fp32)."""
    xf = x.float()
    scales = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(xf / scales).to(torch.int8), scales


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.kernel: Int8Kernel | Int4Kernel | BackendKernel | None = None
        self.loras = LayerAdapters()  # the LoRA adapters that train this layer (`engines.layers.lora`)

    @property
    def format(self) -> str:
        return "bf16" if self.kernel is None else self.kernel.format

    def prepare(self, *, shared: bool = False) -> None:
        """Called once after the weights are loaded. `shared`: the weight is also used elsewhere."""
        if self.kernel is not None or self.packed is not None or not _can_pack(self.weight):
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        if not shared:
            self.weight = None  # the packed copy is all we use from now on

    def set_quantized(self, qw: QuantizedWeight, dtype: torch.dtype, *, shared: bool = False) -> None:
        """Serve from quantized weights; the float weight is dropped unless something else shares it."""
        if qw.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {qw.shape} does not fit {self.out_features}x{self.in_features}")
        run = backend_for(qw.q).weight_kernel(qw, dtype)  # the device's own kernel, if it has one
        if run is not None:
            self.kernel = BackendKernel(qw, run)
        else:
            self.kernel = Int8Kernel(qw, dtype) if qw.format == "int8" else Int4Kernel(qw, dtype)
        self.packed = None
        if not shared:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._base(x)
        if self.loras and (batch := active_batch()) is not None:  # a step with adapters: their rows' deltas
            out = self.loras.add(x, out, batch)
        return out

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, None if self.bias is None else self.bias.detach())
        if self.packed is not None:
            bias = None if self.bias is None else self.bias.detach()
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        """Bytes this layer reads per step for its weight."""
        if self.kernel is not None:
            return self.kernel.nbytes
        w = self.packed if self.packed is not None else self.weight
        return 0 if w is None else w.numel() * w.element_size()

    def extra_repr(self) -> str:
        return f"{self.in_features}→{self.out_features}, bias={self.bias is not None}, format={self.format}"


class Embedding(nn.Module):
    """Token embeddings; quantized rows (int8, or a GGUF's own int4 blocks) when the table is quantized."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.quantized: QuantizedWeight | None = None
        self.dtype = torch.bfloat16

    def set_quantized(self, qw: QuantizedWeight, dtype: torch.dtype) -> None:
        self.quantized, self.dtype = qw, dtype
        self.weight = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return F.embedding(ids, self.weight)
        return self.quantized.rows(ids).dequantize().to(self.dtype)
