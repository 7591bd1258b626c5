"""A tier served by another OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, another switchboard)
behind the same `engines.protocol.TierEngine` interface as an in-process engine (`engine`), with retries and a
circuit breaker that stops calling a remote that keeps failing (`circuit_breaker`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engines.remote.circuit_breaker import CircuitBreaker
    from engines.remote.engine import RemoteConfig, RemoteEngine

__all__ = [
    "CircuitBreaker",
    "RemoteConfig",
    "RemoteEngine",
]

_EXPORTS = {
    "CircuitBreaker": "circuit_breaker",
    "RemoteConfig": "engine",
    "RemoteEngine": "engine",
}


def __getattr__(name: str) -> Any:
    """Each public name is imported from its module on first use: importing the package imports nothing."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
