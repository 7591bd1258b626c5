"""The seccomp filter every jailed program runs under, compiled by libseccomp (`pyseccomp`) to BPF.

Everything is allowed but what would let a program leave the jail or reach past it (each refused with
EPERM, so Python raises `PermissionError` at the call):
- new programs and processes: `execve`, `execveat`, `fork`, `vfork`, and `clone` without `CLONE_THREAD`
  or with any namespace flag (threads stay: `pthread_create` clones with `CLONE_THREAD`); `clone3` answers
  ENOSYS, which makes glibc fall back to `clone`, whose flags a filter can read (clone3's sit in memory);
- sockets of every family: `socket`, `socketpair` (and `connect`, `bind`, `listen`, `accept` for a
  descriptor that came from elsewhere);
- other processes: `ptrace`, `process_vm_readv`/`writev`, `pidfd_open`/`pidfd_getfd`/`pidfd_send_signal`,
  `kcmp`; signals by pid stay for the PID namespace and Landlock's signal scope to bound;
- the kernel's larger doors: namespaces and mounts (`unshare`, `setns`, `mount`, the new mount API,
  `pivot_root`, `chroot`), `bpf`, `perf_event_open`, `userfaultfd`, `io_uring_*` (its socket and open
  operations bypass seccomp), keyrings, modules, `kexec`, `reboot`, swap, clocks, `ioctl(TIOCSTI)` (typing
  into a terminal), file handles (`open_by_handle_at`).
A system call of another ABI (x32, i386 on x86_64) kills the process: libseccomp's bad-arch action.
"""

from __future__ import annotations

import errno
import functools
import tempfile

__all__ = ["DENIED", "FilterUnavailable", "filter_bpf"]

CLONE_THREAD = 0x00010000
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
TIOCSTI = 0x5412

DENIED = (
    *("execve", "execveat", "fork", "vfork"),
    *("socket", "socketpair", "connect", "bind", "listen", "accept", "accept4"),
    *("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_getfd", "pidfd_send_signal", "kcmp"),
    *("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree"),
    *("fsopen", "fsconfig", "fsmount", "fspick", "bpf", "perf_event_open", "userfaultfd"),
    *("io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key"),
    *("init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot"),
    *("swapon", "swapoff", "acct", "quotactl", "syslog", "settimeofday", "clock_settime", "clock_adjtime"),
    *("adjtimex", "sethostname", "setdomainname", "name_to_handle_at", "open_by_handle_at", "vhangup"),
)


class FilterUnavailable(RuntimeError):
    """libseccomp is missing or cannot express the filter: the jail cannot be built."""


@functools.cache
def filter_bpf() -> bytes:
    """The compiled filter (struct sock_filter[] in the machine's byte order), built once per process."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # pyseccomp raises at import when libseccomp.so.2 is not found
        raise FilterUnavailable(f"libseccomp: {exc}") from exc
    try:
        f = sc.SyscallFilter(sc.ALLOW)
        f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
        deny = sc.ERRNO(errno.EPERM)
        for name in DENIED:
            f.add_rule(deny, name)
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))  # a process, not a thread
        for flag in NAMESPACE_FLAGS:
            f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        f.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
        with tempfile.TemporaryFile() as out:
            f.export_bpf(out)
            out.seek(0)
            program = out.read()
    except (OSError, ValueError, RuntimeError) as exc:
        raise FilterUnavailable(f"libseccomp cannot build the filter: {exc}") from exc
    if not program or len(program) % 8:
        raise FilterUnavailable("libseccomp exported no filter")
    return program
