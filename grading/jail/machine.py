"""What this machine offers a jail: bubblewrap, Landlock's ABI, the interpreter's own files.

Nothing here decides whether the jail can be built (`grading.jail.status` does); it only reads the facts,
once per process. `SWITCHBOARD_JAIL_WITHOUT` (a comma list of `bubblewrap`, `landlock`, `seccomp`,
`userns`) makes this process act as if the machine lacked them: it can only take protections away, never
add any, so the fail-closed path is tested on real machines and an operator can try a weaker machine's
configuration before deploying on one.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LAYERS", "Interpreter", "bubblewrap", "interpreter", "landlock_abi", "without"]

LAYERS = ("bubblewrap", "landlock", "seccomp", "userns")
WITHOUT_ENV = "SWITCHBOARD_JAIL_WITHOUT"
LANDLOCK_CREATE_RULESET, LANDLOCK_CREATE_RULESET_VERSION = 444, 1  # the same number on every architecture
# The shared libraries the interpreter and its extension modules load (libc, libm, libffi, libssl, zlib...).
LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")

# Run by the bare interpreter: what it reads to start and import its standard library.
_ASK = "import json, sys, sysconfig; print(json.dumps([sys.executable, sys.path, sysconfig.get_config_var('LIBDIR')]))"


def without() -> frozenset[str]:
    """The layers this process must act as if the machine lacked (`SWITCHBOARD_JAIL_WITHOUT`)."""
    names = {n.strip() for n in os.environ.get(WITHOUT_ENV, "").split(",") if n.strip()}
    unknown = names - set(LAYERS)
    if unknown:  # a typo must not look like a machine that has everything
        raise ValueError(f"{WITHOUT_ENV}: unknown layers {sorted(unknown)}; known: {', '.join(LAYERS)}")
    return frozenset(names)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (not built, off at boot, too old)."""
    if "landlock" in without() or not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    version = libc.syscall(LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION)
    return max(0, int(version))


def bubblewrap() -> str | None:
    """The `bwrap` executable, if there is one (Debian's `bubblewrap` package)."""
    return None if "bubblewrap" in without() else shutil.which("bwrap")


@dataclass(frozen=True)
class Interpreter:
    """The bare interpreter jailed programs run on (the venv's base: no site-packages) and what it reads."""

    executable: str
    reads: tuple[str, ...]  # files and directories, resolved, none beneath another
    devices: tuple[str, ...]
    links: tuple[tuple[str, str], ...]  # (path, target) of library directories that are symlinks (/lib -> usr/lib)


def _outermost(paths: list[str]) -> tuple[str, ...]:
    kept: list[str] = []
    for path in sorted(set(paths), key=len):
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return tuple(sorted(kept))


@functools.cache
def interpreter() -> Interpreter:
    base = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    asked = subprocess.run([base, "-I", "-S", "-c", _ASK], capture_output=True, text=True, timeout=30, env={})
    if asked.returncode != 0:
        raise RuntimeError(f"the interpreter {base} did not start: {asked.stderr[-300:]}")
    executable, path, libdir = json.loads(asked.stdout)
    reads = [os.path.realpath(executable)] + [os.path.realpath(p) for p in path if os.path.exists(p)]
    if libdir and any(Path(libdir).glob("libpython*.so*")):  # a shared libpython lies beside the stdlib
        reads.append(os.path.realpath(libdir))
    links = []
    for d in LIBRARY_DIRS:
        if os.path.islink(d):
            links.append((d, os.readlink(d)))
        if os.path.isdir(d):
            reads.append(os.path.realpath(d))
    if os.path.exists("/etc/ld.so.cache"):  # where dlopen finds libffi, libssl... by name
        reads.append("/etc/ld.so.cache")
    devices = tuple(d for d in DEVICES if os.path.exists(d))
    return Interpreter(os.path.realpath(executable), _outermost(reads), devices, tuple(links))
