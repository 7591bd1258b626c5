"""The label file: one JSON object per line and item, appended and flushed as each item completes.

A run killed mid-write leaves at most one unterminated line; `read_rows` ignores it and `open_appender`
cuts it off before appending, so the file always holds whole rows and a resumed run skips their ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def _complete_bytes(path: Path) -> bytes:
    data = path.read_bytes() if path.is_file() else b""
    return data[: data.rfind(b"\n") + 1]


def read_rows(path: Path) -> list[Row]:
    rows = []
    for number, line in enumerate(_complete_bytes(Path(path)).splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a JSON row: {exc}") from None
    return rows


@contextmanager
def open_appender(path: Path) -> Iterator[Callable[[Row], None]]:
    """A function that appends one row and flushes it; an unterminated last line is dropped first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = len(_complete_bytes(path))
    with path.open("ab") as f:
        if f.tell() != keep:
            f.truncate(keep)
            f.seek(keep)

        def append(row: Row) -> None:
            f.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
            f.flush()

        yield append
