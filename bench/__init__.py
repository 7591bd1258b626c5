"""The benchmarks, each a module run from the repository root: `python -m bench.cache`, `python -m bench.ledger`...

As modules, not scripts, so that no file here shadows a package of the project (run as a script,
`bench/verifiers.py` would be the `verifiers` it imports). `bench.common` holds what the model benchmarks
share and exits at import unless OMP_NUM_THREADS is set; `from_tests` lends them the test suite's helpers
without that check (tests/services.py: PostgreSQL and Redis; tests/live.py; tests/tiny.py), and `timed`
times a call.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parent.parent / "tests"


def from_tests(name: str) -> ModuleType:
    """tests/<name>.py, a plain module of the test suite (`services`, `live`, `tiny`), imported as pytest does:
    with tests/ first on sys.path."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    return importlib.import_module(name)


def timed(fn: Callable[[], object], reps: int, warmup: int = 3) -> list[float]:
    """Seconds of each of `reps` calls of `fn`, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out
