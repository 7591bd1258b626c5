"""The command line of one jailed run: bubblewrap's namespaces and binds, and the launcher's config.

Inside bubblewrap (`Plan.bubblewrap`): new mount, PID, network, IPC, UTS and cgroup namespaces; a read-only
tmpfs root holding only the interpreter's files (read-only), five harmless devices and the run's directory
(the one writable place); no /proc, /sys, /etc, /home, /tmp, /run or /var; a new session (no terminal to
type into); killed with its parent; an empty environment. As root bubblewrap needs no user namespace and
keeps only CAP_SETUID and CAP_SETGID, which the launcher spends on switching to the run's own unprivileged
uid; otherwise it makes a user namespace. Without bubblewrap the launcher alone builds the jail (Landlock,
seccomp). The same paths are Landlock's rules either way, so each layer holds without the other.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from grading.jail.machine import Interpreter

__all__ = ["LAUNCHER", "UID_BASE", "Plan", "command", "prepare", "run_uid"]

LAUNCHER = Path(__file__).with_name("launcher.py").read_text()
# Runs as root get a uid of their own from here (no account has one): no file outside is theirs, no other run
# shares their process count, and their directory (0700) is nobody else's.
UID_BASE, UID_SPAN = 2_000_000_000, 1 << 24


@dataclass(frozen=True)
class Plan:
    """How this machine jails a run: which layers, on which interpreter."""

    interpreter: Interpreter
    bubblewrap: str | None  # bwrap's path, or None: Landlock and seccomp alone
    user_namespace: bool  # bubblewrap makes one (not root)
    landlock_abi: int  # 0: no Landlock layer
    seccomp: bytes | None  # the compiled filter; None only in the unsafe fence
    drop_uid: bool  # root: switch to a uid of the run's own
    hook: bool = False  # the old audit-hook fence (`--unsafe-local-grading` only)


def run_uid() -> int:
    return UID_BASE + secrets.randbelow(UID_SPAN)


def _bwrap(plan: Plan, work: str) -> list[str]:
    assert plan.bubblewrap is not None
    args = [plan.bubblewrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    args += ["--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv", "--hostname", "jail"]
    if plan.user_namespace:
        args += ["--unshare-user"]  # no nested ones: seccomp refuses CLONE_NEWUSER
    else:
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    args += ["--tmpfs", "/"]
    for parent in _parents([*plan.interpreter.reads, *plan.interpreter.devices, work]):
        args += ["--dir", parent]  # 0755; bubblewrap makes a bound file's missing parents 0700
    for path in plan.interpreter.reads:
        args += ["--ro-bind", path, path]
    for link, target in plan.interpreter.links:
        args += ["--symlink", target, link]
    for device in plan.interpreter.devices:
        args += ["--dev-bind", device, device]
    return [*args, "--bind", work, work, "--chdir", work, "--remount-ro", "/", "--"]


def _parents(paths: list[str]) -> list[str]:
    out: dict[str, None] = {}
    for path in paths:
        for parent in reversed(Path(path).parents[:-1]):  # outermost first, "/" left out
            out[str(parent)] = None
    return list(out)


def command(plan: Plan, work: str, limits: tuple[int, ...], ready_fd: int, uid: int | None) -> list[str]:
    """argv for a run in `work` (its directory, already holding program.py)."""
    i = plan.interpreter
    config: dict[str, object] = {"limits": list(limits), "ready_fd": ready_fd, "hook": plan.hook}
    if uid is not None:
        config |= {"uid": uid, "gid": uid}
    if plan.landlock_abi:
        rules = {"abi": plan.landlock_abi, "read": list(i.reads), "write": [work], "devices": list(i.devices)}
        config["landlock"] = rules
    if plan.seccomp is not None:
        config["seccomp"] = base64.b64encode(plan.seccomp).decode()
    launcher = [i.executable, "-I", "-S", "-c", LAUNCHER, json.dumps(config)]
    return [*_bwrap(plan, work), *launcher] if plan.bubblewrap else launcher


def prepare(work: Path, uid: int | None) -> None:
    """The run's directory: its uid's, in a private directory only root can enter (0711: bubblewrap, left
    without CAP_DAC_OVERRIDE, must still change into it before the launcher switches uid)."""
    os.chmod(work, 0o711 if uid is not None else 0o700)
    if uid is not None:
        os.chown(work, uid, uid)
        for child in work.iterdir():
            os.chown(child, uid, uid)
