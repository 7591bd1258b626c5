"""The hot ops, below the model code: the torch reference of each (`reference`), our C++ CPU library
(`cpu_kernels`, `cpu_ops`, `cpu_attention`; sources in `csrc/`), Triton kernels for CUDA (`triton_*`, imported
only when a CUDA backend first runs them), the choice between them by device (`backends`), the quantized
weight formats they read (`quantize`) and the per-step attention metadata (`metadata`). Nothing here imports
`engines.layers` or `engines.models`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines import lazy_exports

if TYPE_CHECKING:
    from engines.kernels.backends import CpuBackend, TorchBackend, TritonBackend, backend_for, use
    from engines.kernels.metadata import AttentionBackend, AttentionMetadata, DecodeGroup, ExtendSpan, RowTables
    from engines.kernels.quantize import QuantizedWeight, quantize, quantize_int4, quantize_int8
    from engines.kernels.reference import TorchPagedAttention

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuBackend",
    "DecodeGroup",
    "ExtendSpan",
    "QuantizedWeight",
    "RowTables",
    "TorchBackend",
    "TorchPagedAttention",
    "TritonBackend",
    "backend_for",
    "quantize",
    "quantize_int4",
    "quantize_int8",
    "use",
]

_EXPORTS = {
    "CpuBackend": "backends",
    "TorchBackend": "backends",
    "TritonBackend": "backends",
    "backend_for": "backends",
    "use": "backends",
    "AttentionBackend": "metadata",
    "AttentionMetadata": "metadata",
    "DecodeGroup": "metadata",
    "ExtendSpan": "metadata",
    "RowTables": "metadata",
    "QuantizedWeight": "quantize",
    "quantize": "quantize",
    "quantize_int4": "quantize",
    "quantize_int8": "quantize",
    "TorchPagedAttention": "reference",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
