"""Text every machine here has without fetching anything: Python's documentation topics and standard
library sources (English prose and code, ~2.7 MB), plus our shipped calibration text. For fitting
things that must not see evaluation data: draft vocabularies, MoE routers."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def python_texts(max_modules: int = 80) -> list[str]:
    import pydoc_data.topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = sorted(stdlib.glob("*.py"))[:max_modules]
    return list(pydoc_data.topics.topics.values()) + [p.read_text(errors="ignore") for p in modules]


def calibration_text() -> str:
    return (Path(__file__).parent / "data" / "calibration.txt").read_text()
