"""A file of usage rows the database could not take yet, shared safely by every process on the host.

Each append and each drain holds an exclusive `flock`, so replicas sharing a home directory can spool
into one file and any of them can drain it. A drain that empties the file unlinks it; an appender
that locked the old inode after the unlink notices (the path no longer names its file) and reopens,
so no row lands in a file nobody will read. Rows are fsynced: a spooled row survives a crash.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


class UsageSpool:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __bool__(self) -> bool:
        try:
            return self.path.stat().st_size > 0
        except FileNotFoundError:
            return False

    def append(self, lines: list[str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked("a") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())

    def drain(self, write: Callable[[list[str]], None]) -> int:
        """Hand every spooled line to `write` (which must be idempotent: a crash between its commit and
        the unlink replays them), then remove the file. If `write` raises, the file stays as it was."""
        if not self:
            return 0
        try:
            with self._locked("r+") as f:
                lines = [line for line in f.read().splitlines() if line.strip()]
                if lines:
                    write(lines)
                self.path.unlink()
        except FileNotFoundError:  # another process drained it first
            return 0
        return len(lines)

    @contextmanager
    def _locked(self, mode: str) -> Iterator[IO[str]]:
        while True:
            f = self.path.open(mode)
            try:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    same = os.fstat(f.fileno()).st_ino == self.path.stat().st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    yield f
                    return
            finally:
                f.close()  # closing drops the lock
