"""Triton kernels on the CPU: the interpreter, and kernels broken on purpose.

Import this before any module holding `@triton.jit` kernels: `triton.jit` reads TRITON_INTERPRET when it
decorates, so a kernel module imported first would hold compiled (CUDA-only) kernels. `mutant` shows a
kernel test can fail: it recompiles a kernel from its own source with one edit (a dropped scale, an
off-by-one mask...) in the kernel module's namespace; the test runs the broken kernel in place of the real
one and asserts its check now fails.
"""

from __future__ import annotations

import inspect
import os
import textwrap
from types import ModuleType

os.environ["TRITON_INTERPRET"] = "1"

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402


def interpreted(kernel: object) -> bool:
    """Whether `kernel` runs under the interpreter (it was decorated after TRITON_INTERPRET was set)."""
    return isinstance(kernel, InterpretedFunction)


def mutant(module: ModuleType, name: str, old: str, new: str) -> object:
    """Kernel `module.name` with `old` replaced by `new` in its source (`old` must occur exactly once)."""
    kernel = getattr(module, name)
    assert interpreted(kernel), f"{module.__name__}.{name} was imported before TRITON_INTERPRET was set"
    source = textwrap.dedent(inspect.getsource(kernel.fn))
    assert source.count(old) == 1, f"{old!r} occurs {source.count(old)} times in {name}"
    namespace = dict(vars(module))
    exec(compile(source.replace(old, new), f"<mutant of {module.__name__}.{name}>", "exec"), namespace)
    return namespace[name]
