"""One run of a program under a `Plan`: its directory, the child, the wall clock, what it printed.

The program gets a fresh directory (mode 0700, its uid's) inside a private one that also holds its
captured stdout and stderr, which it cannot reach. The wall-clock timeout kills bubblewrap (its PID
namespace dies with it) or, without bubblewrap, the launcher's process group; the child cannot fork, so
that is everything it started. A run the launcher did not mark ready (the ready pipe's byte) never ran
the program: `JailFailed`, never a result that could pass for the program's.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from grading.jail.command import Plan, command, prepare, run_uid

__all__ = ["JailFailed", "Limits", "SandboxResult", "run"]

OUTPUT_HEAD, OUTPUT_TAIL = 4096, 4096


class JailFailed(RuntimeError):
    """The jail could not be built for this run; the program did not run."""


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20  # output files too: a program printing forever dies of SIGXFSZ
    processes: int = 64  # threads count too; per uid, and a root run has a uid of its own
    open_files: int = 256

    def values(self, timeout: float) -> tuple[int, ...]:
        """The launcher's order: address space, CPU seconds, file size, processes, open files, core size.
        CPU time a little past the wall clock: the wall clock normally ends it, the CPU limit if it cannot."""
        return (self.memory_bytes, math.ceil(timeout) + 1, self.file_bytes, self.processes, self.open_files, 0)


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # negative: killed by that signal; None: killed at the wall-clock timeout
    timed_out: bool
    stdout: str  # its first 4 kB
    stderr: str  # its last 4 kB, where a traceback ends

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def run(plan: Plan, program: str, timeout: float, limits: Limits, prefix: list[str] | None = None) -> SandboxResult:
    """Run `program` (source text) under `plan`; `prefix` goes before the command (the old fence's `unshare`)."""
    uid = run_uid() if plan.drop_uid else None
    ready = False
    with tempfile.TemporaryDirectory(prefix="switchboard-sandbox-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        (work / "program.py").write_text(program)
        prepare(work, uid)
        ready_r, ready_w = os.pipe()
        try:
            with (Path(tmp) / "stdout").open("w+b") as out, (Path(tmp) / "stderr").open("w+b") as err:
                argv = [*(prefix or []), *command(plan, str(work), limits.values(timeout), ready_w, uid)]
                returncode, timed_out = _wait(argv, str(work), out, err, ready_w, timeout)
                os.close(ready_w)
                ready_w = -1
                os.set_blocking(ready_r, False)  # the byte is there if the program ran; never wait for it
                with contextlib.suppress(BlockingIOError):
                    ready = os.read(ready_r, 1) == b"1"
                out.seek(0)
                err.seek(0)
                stdout = out.read(OUTPUT_HEAD).decode(errors="replace")
                stderr = err.read()[-OUTPUT_TAIL:].decode(errors="replace")
        finally:
            os.close(ready_r)
            if ready_w >= 0:
                os.close(ready_w)
    if not ready:
        raise JailFailed(stderr.strip()[-500:] or f"the launcher exited with {returncode} before the program ran")
    return SandboxResult(None if timed_out else returncode, timed_out, stdout, stderr)


def _wait(argv: list[str], cwd: str, out: BinaryIO, err: BinaryIO, ready_w: int, timeout: float) -> tuple[int, bool]:
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env={},
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        pass_fds=(ready_w,),
        start_new_session=True,  # its own process group: a timeout kills the group
    )
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group is gone: nothing left running
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, timed_out
