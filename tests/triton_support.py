"""Triton kernels on the CPU: the interpreter, and kernels broken on purpose; on a GPU, compiled.

Import this before any module holding `@triton.jit` kernels: `triton.jit` reads TRITON_INTERPRET when it
decorates, so a kernel module imported first would hold compiled (CUDA-only) kernels. `mutant` shows a
kernel test can fail: it recompiles a kernel from its own source with one edit (a dropped scale, an
off-by-one mask...) in the kernel module's namespace; the test runs the broken kernel in place of the real
one and asserts its check now fails.

bf16 is the one dtype the interpreter cannot run (it holds bf16 as raw uint16: `tl.dot` multiplies the bit
patterns and fp32->bf16 casts truncate), so the kernel tests' bf16 cases run compiled on a CUDA device, in a
child process (`on_gpu`), and skip (`BF16_NEEDS_CUDA`) where there is none.

Triton is a test dependency where its wheels exist, Linux x86_64 (pyproject.toml's `test` extra): there it is
imported like any other; elsewhere the Triton tests skip, saying so.
"""

from __future__ import annotations

import inspect
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

# Where pyproject.toml's `test` extra installs Triton (the same marker).
TRITON_DECLARED = platform.system() == "Linux" and platform.machine() == "x86_64"
if TRITON_DECLARED:
    import triton
else:
    triton = pytest.importorskip(
        "triton", reason="Triton is a test dependency on Linux x86_64 only (pyproject.toml), not installed here"
    )
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

CUDA = torch.cuda.is_available()
# Its reason starts "needs a CUDA device", as every GPU-only skip's does: the skips `.ci/run` allows
# (tests/skip_audit.py).
BF16_NEEDS_CUDA = pytest.mark.skipif(
    not CUDA,
    reason="needs a CUDA device: bf16 cases run compiled there, since the Triton interpreter holds bf16 as raw "
    "uint16 (tl.dot multiplies the bit patterns, fp32->bf16 casts truncate); this machine has none",
)


def interpreted(kernel: object) -> bool:
    """Whether `kernel` runs under the interpreter (it was decorated after TRITON_INTERPRET was set)."""
    return isinstance(kernel, InterpretedFunction)


def poison_new_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """New float tensors from `torch.empty`/`empty_like` hold NaN for the rest of the test: an output row a
    broken kernel leaves unwritten must not hold an earlier run's right answer (the allocator hands the
    same memory back, so a mutant that skips a tile passed now and then)."""
    for name in ("empty", "empty_like"):
        make = getattr(torch, name)

        def poisoned(*args: Any, _make: Any = make, **kwargs: Any) -> torch.Tensor:
            out = _make(*args, **kwargs)
            return out.fill_(float("nan")) if out.is_floating_point() else out

        monkeypatch.setattr(torch, name, poisoned)


def on_gpu(runner: str, *args: Any, device: str = "cuda") -> Any:
    """`runner(*args)` of tests/triton_compiled.py (a kernel call: `matmul`, `attention`, `store`, `moe`) in a
    child process, on the CUDA device with the kernels compiled; its result comes back on the CPU. A child:
    this process imported Triton for the interpreter, its standard library (`tl.sum`, `tl.sigmoid`...)
    included, so no kernel compiles here. `device="cpu"` runs it interpreted instead (a check of the round
    trip on machines without a GPU)."""
    with tempfile.TemporaryDirectory(prefix="switchboard-triton-") as tmp:
        calls, results = Path(tmp) / "calls.pt", Path(tmp) / "results.pt"
        torch.save([(runner, args)], calls)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        code = "import runpy; runpy.run_path('tests/triton_compiled.py', run_name='__main__')"
        _child([code, device, str(calls), str(results)], env, timeout=600)
        (result,) = torch.load(results, weights_only=False)
    return result


def mutant(module: ModuleType, name: str, old: str, new: str) -> object:
    """Kernel `module.name` with `old` replaced by `new` in its source (`old` must occur exactly once)."""
    kernel = getattr(module, name)
    assert interpreted(kernel), f"{module.__name__}.{name} was imported before TRITON_INTERPRET was set"
    source = textwrap.dedent(inspect.getsource(kernel.fn))
    assert source.count(old) == 1, f"{old!r} occurs {source.count(old)} times in {name}"
    namespace = dict(vars(module))
    exec(compile(source.replace(old, new), f"<mutant of {module.__name__}.{name}>", "exec"), namespace)
    return namespace[name]


_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module = importlib.import_module(sys.argv[1])
ptx = []
for name, types, constexprs in json.loads(sys.argv[2]):
    kernel = getattr(module, name)
    signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in kernel.arg_names}
    asm = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32)).asm
    assert asm["cubin"], name
    ptx.append(asm["ptx"])
print(json.dumps(ptx))
"""


def compile_for_h100(
    module: str, cases: list[tuple[str, dict[str, str], dict[str, object]]], cache_dir: Path
) -> list[str]:
    """PTX of each (kernel, argument types, constexprs) case of `module`'s kernels, lowered to an sm_90
    (H100) cubin with Triton's own ptxas: what the interpreter cannot show (layouts, register pressure,
    dtypes it never lowers), no GPU needed. Arguments missing from the types are i32. In a child process:
    this one's kernels were jitted for the interpreter. (Triton's Linux x86_64 wheels ship the NVIDIA backend
    and its ptxas.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache_dir)}
    ptx = json.loads(_child([_COMPILE, module, json.dumps(cases)], env, timeout=300))
    assert len(ptx) == len(cases)
    return ptx


def _child(args: list[str], env: dict[str, str], timeout: float) -> str:
    """`python -c args...` from the repository root with `env`; its stdout (it must succeed)."""
    done = subprocess.run(
        [sys.executable, "-c", *args],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
