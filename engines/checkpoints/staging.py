"""Checkpoint directories written whole or not at all: into a staging directory beside the target, renamed
into place when complete (replacing an older one), removed when the writing fails."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """A fresh directory to write `out`'s contents into; it becomes `out` when the block completes."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield staging
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
