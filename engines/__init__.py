"""The in-process inference engine, bottom up: `kernels` (the hot ops: torch reference, C++ CPU library,
Triton) and `kv` (the paged KV pool, shared budgets, the Redis prefix tier); `layers` and `models` (the
decoders); `checkpoints` (weights on disk: fetch, convert, quantize, load); `speculative` (drafting and
verification); on top, the engine itself (`engine`: scheduler, block manager, model runner, sampler) and
what the gateway sees of it (`protocol`, `request`, `async_engine`), with `remote` serving a tier from
another server behind the same protocol. Importing this package imports nothing: `engines.checkpoints.fetch`
stays torch-free.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A sub-package's module `__getattr__`: each public name (name → module) is imported on first use,
    so importing the sub-package imports nothing."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
