"""What /proc/cpuinfo says of this CPU: its feature flags, model name and family. Torch-free, so the
benchmarks, the llama.cpp build and the tests read the CPU the way the kernel dispatch does."""

from __future__ import annotations

import functools
import re
from pathlib import Path

__all__ = ["cpu_flags", "cpu_model", "cpu_name", "cpuinfo"]


@functools.cache
def cpuinfo() -> str:
    """The file's text; empty where there is none (not Linux, a locked-down container)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags(text: str | None = None) -> frozenset[str]:
    """The feature flags as /proc/cpuinfo names them (its first `flags` line; empty where there is none);
    `text`: another machine's file."""
    for line in (cpuinfo() if text is None else text).splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _field(name: str) -> str | None:
    found = re.search(rf"^{name}\s*:\s*(.+)$", cpuinfo(), re.M)
    return found.group(1).strip() if found else None


def cpu_model() -> str:
    """The model name ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8488C"), or "unknown"."""
    return _field("model name") or "unknown"


def cpu_name() -> str:
    """The model name and family ("AMD EPYC (family 25)"): AMD's virtual CPUs often say only "AMD EPYC"."""
    return f"{cpu_model()} (family {_field('cpu family') or '?'})"
