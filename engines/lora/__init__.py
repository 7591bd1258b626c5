"""LoRA adapters served on an engine's base model, many at once: PEFT's directory format read into pairs for our
fused layers (`adapter`), held by name with a bound in memory (`registry`). The per-row deltas of a mixed batch
are a layer's concern (`engines.layers.lora`), below the models this package loads onto.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines import lazy_exports

if TYPE_CHECKING:
    from engines.lora.adapter import (
        CONFIG,
        PROJECTIONS,
        WEIGHTS,
        AdapterError,
        LoraAdapter,
        check_adapter,
        load_adapter,
    )
    from engines.lora.registry import DEFAULT_CAPACITY, Adapters

__all__ = [
    "CONFIG",
    "DEFAULT_CAPACITY",
    "PROJECTIONS",
    "WEIGHTS",
    "AdapterError",
    "Adapters",
    "LoraAdapter",
    "check_adapter",
    "load_adapter",
]

_EXPORTS = {
    "CONFIG": "adapter",
    "PROJECTIONS": "adapter",
    "WEIGHTS": "adapter",
    "AdapterError": "adapter",
    "check_adapter": "adapter",
    "LoraAdapter": "adapter",
    "load_adapter": "adapter",
    "DEFAULT_CAPACITY": "registry",
    "Adapters": "registry",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
