"""A tier served by another OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, another switchboard)
behind the same `engines.protocol.TierEngine` interface as an in-process engine (`engine`), with retries and a
circuit breaker that stops calling a remote that keeps failing (`circuit_breaker`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines import lazy_exports

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

__getattr__ = lazy_exports(__name__, _EXPORTS)
