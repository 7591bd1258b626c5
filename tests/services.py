"""PostgreSQL and Redis for the test suite: the local servers when reachable, else throwaway ones.

Order of preference: `SWITCHBOARD_TEST_POSTGRES_URL` / `SWITCHBOARD_TEST_REDIS_URL`, then the servers
on 127.0.0.1 (5432, database `test`; 6379), then fresh instances started here from the installed
server binaries on free ports, stopped when the test session ends.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

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
        raise RuntimeError(f"no PostgreSQL reachable on 127.0.0.1:5432 and no `{name}` binary to start one")
    return found


def _throwaway_postgres() -> str:
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="switchboard-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root; use its own system account
        shutil.chown(data, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    run = lambda *cmd: subprocess.run([*as_user, *cmd], check=True, capture_output=True)  # noqa: E731
    run(_pg_binary("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
    run(
        _pg_binary("pg_ctl"),
        "-D",
        str(data),
        "-l",
        str(data / "log"),
        "-w",
        "-o",
        f"-p {port} -h 127.0.0.1 -k {data}",
        "start",
    )

    def stop() -> None:
        subprocess.run(
            [*as_user, _pg_binary("pg_ctl"), "-D", str(data), "-m", "immediate", "stop"], capture_output=True
        )
        shutil.rmtree(data, ignore_errors=True)

    _cleanups.append(stop)
    run(_pg_binary("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "test")
    return f"postgresql+psycopg://postgres@127.0.0.1:{port}/test"


def _throwaway_redis() -> str:
    binary = shutil.which("redis-server")
    if not binary:
        raise RuntimeError("no Redis reachable on 127.0.0.1:6379 and no `redis-server` binary to start one")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _cleanups.append(lambda: (proc.terminate(), proc.wait(10)))
    deadline = time.monotonic() + 10
    while not reachable(port):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)
    return f"redis://127.0.0.1:{port}/0"


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
