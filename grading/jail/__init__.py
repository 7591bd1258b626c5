"""The kernel-enforced jail model- and prompt-written code runs in (`grading.sandbox` is its one caller).

Bottom up, each module importing only those above it in this list:
- `launcher`: the jail's inside, standard library only: limits, the uid switch, no_new_privs, Landlock,
  the seccomp filter, then the program;
- `syscalls`: the seccomp filter (libseccomp through `pyseccomp`): what a jailed program may not call;
- `machine`: what this machine offers (bubblewrap, Landlock's ABI, the interpreter's files), and
  `SWITCHBOARD_JAIL_WITHOUT` to act as if it offered less;
- `command`: one run's command line (bubblewrap's namespaces and binds) and the launcher's config;
- `process`: one run: its private directory, the child, the wall clock, the output;
- `status`: which plan this machine can jail with, proven on a canary, or why none (fail closed).
"""

__all__ = ["command", "launcher", "machine", "process", "status", "syscalls"]
