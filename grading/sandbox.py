"""Run model- and prompt-written Python in the kernel-enforced jail (`grading.jail`): unit tests of code
answers (HumanEval grading), the code checks (`code`, `prompt_examples`), the math check's programs.

`run_python(program)` runs it as `python -I -S` on the bare interpreter (standard library only) in a fresh
directory with an empty environment, limits on memory, CPU time, file size, processes and open files,
and a wall-clock kill, inside the jail `grading.jail.status` proved on this machine: no new programs, no
sockets, reads only of the interpreter's own files, writes only in its directory, no signals or ptrace
outside, an unprivileged uid where the gateway is root. Where the machine cannot build it, nothing runs:
`JailUnavailable`. The checks report `unavailable`, the benches refuse to grade unless started with
`--unsafe-local-grading`, which (`allow_unsafe_local_grading()`, for `local_grading=True` callers only:
never a tenant's check) runs it under the old fence instead: an audit hook, limits and `unshare -rn`,
which a hostile program leaves at will.
"""

from __future__ import annotations

import functools
import logging
import shutil
import subprocess
import threading

from grading.jail.command import Plan
from grading.jail.machine import interpreter
from grading.jail.process import JailFailed, Limits, SandboxResult, run
from grading.jail.status import JailStatus, jail_status

__all__ = [
    "JailUnavailable",
    "SandboxResult",
    "add_unsafe_flag",
    "allow_unsafe_local_grading",
    "jail_status",
    "require_jail",
    "run_python",
    "run_unjailed",
]

log = logging.getLogger(__name__)

MEMORY_BYTES = 1 << 30
TIMEOUT_S = 10.0
UNSAFE_FLAG = "--unsafe-local-grading"
_unsafe = threading.Event()


class JailUnavailable(RuntimeError):
    """This machine cannot jail a program (or the jail failed to start this time): nothing was run."""


def allow_unsafe_local_grading() -> None:
    """The operator's `--unsafe-local-grading`: `local_grading=True` runs use the old fence where the jail
    is unavailable. Process-wide, and never consulted by a tenant's checks (they pass `local_grading=False`)."""
    if not jail_status().available:
        reason = jail_status().reason
        log.warning("%s: graded programs run under the audit-hook fence, not a jail: %s", UNSAFE_FLAG, reason)
    _unsafe.set()


def require_jail(unsafe_local_grading: bool, what: str = "HumanEval grading", *, unsafe_allowed: bool = True) -> None:
    """For a bench or CLI about to run model-written code: refuse (SystemExit) without a jail, unless told it
    may grade unjailed (`unsafe_allowed`: graders only; the checks themselves never run unjailed)."""
    if unsafe_local_grading and unsafe_allowed:
        allow_unsafe_local_grading()
    elif not jail_status().available:
        way_out = f" or pass {UNSAFE_FLAG} to run it unjailed" if unsafe_allowed else ""
        raise SystemExit(
            f"{what} runs model-written code, and this machine cannot jail it: {jail_status().reason}. "
            f"Install bubblewrap (Debian: apt-get install bubblewrap){way_out}; see docs/verifiers.md#the-jail."
        )


def add_unsafe_flag(parser: object) -> None:
    """`--unsafe-local-grading` on an argparse parser (or sub-parser)."""
    parser.add_argument(  # type: ignore[attr-defined]
        UNSAFE_FLAG,
        action="store_true",
        help="where this machine cannot jail code, grade HumanEval under the old audit-hook fence anyway "
        "(a hostile answer can leave it; never for a tenant's checks)",
    )


@functools.cache
def _unshare() -> list[str]:
    """`unshare -rn` (a user and network namespace: no network) where this machine allows it: the old fence."""
    tool = shutil.which("unshare")
    if tool is None:
        return []
    try:
        ok = subprocess.run([tool, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return [tool, "-rn"] if ok else []


def _fence() -> Plan:
    return Plan(interpreter(), None, False, 0, None, False, hook=True)


def run_unjailed(program: str, *, timeout: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES) -> SandboxResult:
    """The old fence alone (`--unsafe-local-grading` where there is no jail, and the tests that show what it
    lets through): limits, the audit hook, `unshare -rn`; no kernel rules, no uid switch."""
    return run(_fence(), program, timeout, Limits(memory_bytes=memory_bytes), prefix=_unshare())


def run_python(
    program: str, *, timeout: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES, local_grading: bool = False
) -> SandboxResult:
    """Run `program` (source text) in the jail; `passed` means it exited with status 0. Raises
    `JailUnavailable` where there is no jail, unless `local_grading` and the operator allowed the old fence."""
    status: JailStatus = jail_status()
    limits = Limits(memory_bytes=memory_bytes)
    if status.plan is None:
        if not (local_grading and _unsafe.is_set()):
            raise JailUnavailable(status.reason)
        return run_unjailed(program, timeout=timeout, memory_bytes=memory_bytes)
    try:
        return run(status.plan, program, timeout, limits)
    except JailFailed as exc:
        raise JailUnavailable(f"the jail failed to start: {exc}") from exc
