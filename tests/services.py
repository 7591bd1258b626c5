"""PostgreSQL and Redis for the test suite: the local servers when reachable, else throwaway ones.

Order of preference: `SWITCHBOARD_TEST_POSTGRES_URL` / `SWITCHBOARD_TEST_REDIS_URL`, then the servers
on 127.0.0.1 (5432, database `test`; 6379), then fresh instances started here from the installed
server binaries on free ports, stopped when the test session ends.

Missing server binaries fail, they never skip. The throwaway servers above are how a fresh machine without
PostgreSQL or Redis running runs this suite at all, so the binaries are part of what the suite needs; the
outage tests, which stop and start a server of their own (`RedisServer`, `PostgresCluster`), get them the
same way and fail the same way, with a message naming what to install. A skip there would hide that the
outage tests did not run (and `.ci/run` fails on any skip that is not GPU-only: tests/skip_audit.py).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import httpx
import sqlalchemy as sa

_cleanups: list[Callable[[], None]] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reachable(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def postgres_url() -> str:
    if url := os.environ.get("SWITCHBOARD_TEST_POSTGRES_URL"):
        return url
    if reachable(5432) and not os.environ.get("SWITCHBOARD_TEST_THROWAWAY"):
        return "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    return _throwaway_postgres()


def redis_url() -> str:
    if url := os.environ.get("SWITCHBOARD_TEST_REDIS_URL"):
        return url
    if reachable(6379) and not os.environ.get("SWITCHBOARD_TEST_THROWAWAY"):
        return "redis://127.0.0.1:6379/0"
    return _throwaway_redis()


def delete_namespace(url: str, namespace: str) -> None:
    """Delete every Redis key under `namespace:` (tests and benchmarks keep apart by namespace, never flush)."""
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(f"{namespace}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def stop_all() -> None:
    while _cleanups:
        _cleanups.pop()()


def _pg_binary(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if not found:
        raise RuntimeError(
            f"no `{name}` binary: the tests start PostgreSQL servers of their own (a throwaway one where none "
            "answers on 127.0.0.1:5432, and one to stop and restart in the outage tests); install PostgreSQL's "
            "server (Debian: apt-get install postgresql)"
        )
    return found


def redis_binary() -> str:
    """The `redis-server` binary; RuntimeError naming what to install where there is none (see above)."""
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError(
            "no `redis-server` binary: the tests start Redis servers of their own (a throwaway one where none "
            "answers on 127.0.0.1:6379, and ones to kill and restart in the outage tests); install Redis's "
            "server (Debian: apt-get install redis-server)"
        )
    return found


class PostgresCluster:
    """A PostgreSQL cluster of our own (initdb in a temporary directory, a free port) that a test can stop
    and start again: a database outage."""

    def __init__(self) -> None:
        self.port = free_port()
        self.data = Path(tempfile.mkdtemp(prefix="switchboard-pg-"))
        self._as_user: list[str] = []
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root; use its own system account
            shutil.chown(self.data, "postgres", "postgres")
            self._as_user = ["runuser", "-u", "postgres", "--"]
        self._run(_pg_binary("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")

    def url(self, database: str = "test") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        self._pg_ctl("-l", str(self.data / "log"), "-w", "-o", f"-p {self.port} -h 127.0.0.1 -k {self.data}", "start")

    def stop(self, mode: str = "fast") -> None:
        """`fast` ends every session and stops at once (what an operator's restart does); `immediate` crashes."""
        self._pg_ctl("-m", mode, "-w", "stop")

    def create_test_database(self) -> None:
        self._run(_pg_binary("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "test")

    def remove(self) -> None:
        subprocess.run(
            [*self._as_user, _pg_binary("pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"], capture_output=True
        )
        shutil.rmtree(self.data, ignore_errors=True)

    def _pg_ctl(self, *args: str) -> None:
        self._run(_pg_binary("pg_ctl"), "-D", str(self.data), *args)

    def _run(self, *cmd: str) -> None:
        subprocess.run([*self._as_user, *cmd], check=True, capture_output=True)


class RedisServer:
    """A redis-server of our own on a free port, without persistence, that a test can stop and start
    again on the same port: an outage after which Redis comes back empty."""

    def __init__(self, log: Path | None = None) -> None:
        """`log`: a file to append the server's output to (default: discarded)."""
        self.binary = redis_binary()
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if self.log is None:
            self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            with self.log.open("a") as out:
                self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not reachable(self.port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("redis-server did not start" + (f"; see {self.log}" if self.log else ""))
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def kill(self) -> None:
        """A crash: SIGKILL, nothing flushed or closed (resumed first, in case a test froze it)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def exit_description(code: int) -> str:
    """A process's exit status in words: `killed by SIGILL (signal 4)`, `exited with status 1`."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (signal {-code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def log_tail(log: Path, chars: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"(its log {log} cannot be read: {e})"


def wait_serving(proc: subprocess.Popen, url: str, log: Path, deadline: float, what: str, every: float = 0.1) -> None:
    """Until GET `url` answers 200; fails, quoting how it ended and the end of the server's `log`, if the process
    exits or `deadline` (time.monotonic) passes first."""
    while True:
        code = proc.poll()
        assert code is None, f"{what} {exit_description(code)} while starting; the end of its log:\n{log_tail(log)}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{what} did not start:\n{log_tail(log)}"
        time.sleep(every)


class ServerProcess:
    """A server in a process of its own, its output appended to `log`: started until it serves, killed as
    a crash, or stopped.

    One that dies unasked (not through `kill` or `stop`) is a server death, which `death` describes; a failing
    test reports every such death first (tests/server_deaths.py), so a crash reads as a crash rather than as the
    connection error the test saw next.
    """

    running: ClassVar[list[ServerProcess]] = []  # launched and not stopped, for tests/server_deaths.py

    def __init__(self, log: Path, what: str) -> None:
        self.log, self.what = log, what
        self.proc: subprocess.Popen | None = None
        self.asked_to_exit = False

    def launch(
        self, command: list[str], ready_url: str, timeout: float, env: dict[str, str] | None = None, every: float = 0.1
    ) -> None:
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.asked_to_exit = False
        if self not in ServerProcess.running:
            ServerProcess.running.append(self)
        wait_serving(self.proc, ready_url, self.log, time.monotonic() + timeout, self.what, every)

    def death(self) -> str | None:
        """How the server ended, if it exited unasked: its exit (the signal, by name) and the end of its log."""
        if self.proc is None or self.asked_to_exit or self.proc.poll() is None:
            return None
        how = exit_description(self.proc.returncode)
        return f"{self.what} died ({how}, pid {self.proc.pid}); the end of its log, {self.log}:\n{log_tail(self.log)}"

    def kill(self) -> None:
        """SIGKILL: a crash, no goodbye to open connections."""
        assert self.proc is not None
        self.asked_to_exit = True
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        self.asked_to_exit = True
        if self in ServerProcess.running:
            ServerProcess.running.remove(self)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def _throwaway_postgres() -> str:
    cluster = PostgresCluster()
    cluster.start()
    _cleanups.append(cluster.remove)
    cluster.create_test_database()
    return cluster.url()


def _throwaway_redis() -> str:
    server = RedisServer()
    server.start()
    _cleanups.append(server.stop)
    return server.url


def create_database(server_url: str) -> tuple[str, Callable[[], None]]:
    """A fresh, empty database on `server_url`; returns its URL and a function that drops it."""
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    name = f"sb_test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return sa.make_url(server_url).set(database=name).render_as_string(hide_password=False), drop
