"""Whether this machine can jail a program, how, and proof that it does: `jail_status()`.

A jail needs every guarantee held by at least one kernel mechanism, or nothing runs (fail closed):
- seccomp (always): no execve, no new processes, no sockets, no namespaces, no ptrace;
- the filesystem: bubblewrap's mount namespace, or Landlock (both where there are both);
- signals: bubblewrap's PID namespace, or Landlock's signal scope (ABI 6, Linux 6.12);
- as root, bubblewrap: it is what lets the run switch to an unprivileged uid and still see its interpreter
  (the gateway's own files may sit in a home only root can enter).
Bubblewrap as an unprivileged user needs a user namespace; where those are off, the jail is Landlock and
seccomp alone. Whichever plan the facts allow is then proven on a canary program that tries to fork,
exec, open a socket, signal this process, read a file outside and write one: a plan is used only if all
six are refused. Computed once per process (`jail_status.cache_clear()` to look again).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from grading.jail.command import Plan
from grading.jail.machine import bubblewrap, interpreter, landlock_abi, without
from grading.jail.process import JailFailed, Limits, run
from grading.jail.syscalls import DENIED, FilterUnavailable, filter_bpf

__all__ = ["JailStatus", "jail_status"]

CANARY = """\
import os, socket, sys
escaped = []
def refused(what, attempt):
    try:
        attempt()
    except OSError:
        return
    escaped.append(what)
def fork():
    if os.fork() == 0:
        os._exit(0)
refused("fork", fork)
refused("socket", lambda: socket.socket(socket.AF_UNIX))
refused("signal", lambda: os.kill({pid}, 0))
refused("read", lambda: open({outside!r}, "rb").read(1))
refused("write", lambda: open({beside!r}, "w"))
refused("exec", lambda: os.execv(sys.executable, [sys.executable, "-c", "pass"]))  # a success prints nothing
print("escaped: " + ", ".join(escaped) if escaped else "jail holds")
"""


@dataclass(frozen=True)
class JailStatus:
    plan: Plan | None  # None: this machine cannot jail a program, and none will run
    layers: Mapping[str, str] = field(default_factory=dict)  # each protection: "on: ..." or "off: why"
    reason: str = ""  # why there is no jail

    @property
    def available(self) -> bool:
        return self.plan is not None

    def as_dict(self) -> dict[str, object]:
        return {"jail": "on" if self.available else "unavailable", "reason": self.reason, "layers": dict(self.layers)}


def _outside_file() -> str:
    """A file every machine has and no jail may read."""
    for path in ("/etc/passwd", "/etc/hostname", "/etc/os-release", os.path.realpath(__file__)):
        if os.path.isfile(path):
            return path
    raise FileNotFoundError("no file to try reading")


def _missing(plan: Plan, root: bool) -> str:
    if plan.seccomp is None:
        return "no seccomp filter"
    if root and plan.bubblewrap is None:
        return "running as root, the jail needs bubblewrap to switch to an unprivileged uid"
    if plan.bubblewrap is None and plan.landlock_abi == 0:
        return "neither a mount namespace (bubblewrap) nor Landlock confines the filesystem"
    if plan.bubblewrap is None and plan.landlock_abi < 6:
        return "neither a PID namespace (bubblewrap) nor Landlock's signal scope (ABI 6, Linux 6.12) confines signals"
    return ""


def _self_test(plan: Plan) -> str:
    """'' when the canary was refused everything; else what got through, or why the jail did not start."""
    import tempfile

    with tempfile.TemporaryDirectory() as beside:
        canary = CANARY.format(pid=os.getpid(), outside=_outside_file(), beside=os.path.join(beside, "escape"))
        try:
            result = run(plan, canary, timeout=20.0, limits=Limits())
        except JailFailed as exc:
            return f"the jail did not start: {exc}"
        if os.path.exists(os.path.join(beside, "escape")):
            return "the canary wrote outside its directory"
    said = result.stdout.strip()
    return "" if said == "jail holds" and result.passed else (said or result.stderr.strip()[-300:] or "no answer")


@functools.cache
def jail_status() -> JailStatus:
    layers: dict[str, str] = {}
    root = os.geteuid() == 0
    try:
        bpf = None if "seccomp" in without() else filter_bpf()
        layers["seccomp"] = f"on: {len(DENIED) + 2} system calls refused" if bpf else "off: turned off"
    except FilterUnavailable as exc:
        bpf, layers["seccomp"] = None, f"off: {exc}"
    abi = landlock_abi()
    layers["landlock"] = f"on: ABI {abi}" + (" (files, TCP, signals)" if abi >= 6 else "") if abi else "off: none"
    bwrap, userns = bubblewrap(), "userns" not in without()
    layers["bubblewrap"] = f"candidate: {bwrap}" if bwrap else "off: not installed (Debian's bubblewrap)"
    layers["uid"] = "a uid of its own per run (the gateway is root)" if root else "the gateway's own (not root)"
    candidates = []
    if bwrap and (root or userns):
        candidates.append(Plan(interpreter(), bwrap, not root, abi, bpf, root))
    elif bwrap:
        layers["bubblewrap"] = "off: not root and no user namespaces"
    if not root:
        candidates.append(Plan(interpreter(), None, False, abi, bpf, False))
    reasons = []
    for plan in candidates or [Plan(interpreter(), None, False, abi, bpf, root)]:
        if why := _missing(plan, root) or _self_test(plan):
            reasons.append(why)
            if plan.bubblewrap:
                layers["bubblewrap"] = f"off: {why}"
            continue
        if plan.bubblewrap:
            layers["bubblewrap"] = "on: mount, PID, network, IPC and UTS namespaces" + (", user" if not root else "")
        layers["self_test"] = "passed: fork, exec, socket, signal, read and write outside refused"
        return JailStatus(plan, layers)
    layers["self_test"] = "not passed"
    return JailStatus(None, layers, "; ".join(reasons))
