"""Model weights on disk: the registry of models we serve and their download (`registry`, `fetch`; torch-free),
GGUF conversion (`gguf_convert`, `gguf_quant`), quantized checkpoints (`quant_state`, the format; `quantized`,
making them), loading any of them into our decoders (`loader`), MoE models built from dense ones
(`moe_build`), calibration text (`corpus`, `data/`) and perplexity through the engine (`quality`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines import lazy_exports

if TYPE_CHECKING:
    from engines.checkpoints.fetch import (
        FetchError,
        fetch_model,
        fetch_package_file,
        is_fetched,
        model_dir,
        quantized_dir,
    )
    from engines.checkpoints.loader import load_model
    from engines.checkpoints.moe_build import build_moe
    from engines.checkpoints.quality import perplexity, token_nll
    from engines.checkpoints.quantized import fetch_quantized, is_quantized_dir, quantize_checkpoint
    from engines.checkpoints.registry import REGISTRY, RegistryModel

__all__ = [
    "REGISTRY",
    "FetchError",
    "RegistryModel",
    "build_moe",
    "fetch_model",
    "fetch_package_file",
    "fetch_quantized",
    "is_fetched",
    "is_quantized_dir",
    "load_model",
    "model_dir",
    "perplexity",
    "quantize_checkpoint",
    "quantized_dir",
    "token_nll",
]

_EXPORTS = {
    "FetchError": "fetch",
    "fetch_model": "fetch",
    "fetch_package_file": "fetch",
    "is_fetched": "fetch",
    "model_dir": "fetch",
    "quantized_dir": "fetch",
    "load_model": "loader",
    "build_moe": "moe_build",
    "perplexity": "quality",
    "token_nll": "quality",
    "fetch_quantized": "quantized",
    "is_quantized_dir": "quantized",
    "quantize_checkpoint": "quantized",
    "REGISTRY": "registry",
    "RegistryModel": "registry",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
