"""bench.distill: the tenant's history and its future are disjoint by prompt, the history keeps the trace's mix
by source, the small runs ask each distinct future prompt once, and the per-source accuracy and gain helpers
count what they say. (The bench itself is hours of CPU on the default profile: docs/adapters.md has its run.)"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is no installed package: import it as `python -m bench.X` does
    sys.path.insert(0, str(ROOT))

from bench.distill import _points, by_source, history_requests, originals  # noqa: E402
from bench.savings_trace import SHARES, build_trace, load_pools, quotas  # noqa: E402

HOME = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()


@pytest.fixture(scope="module")
def pools() -> dict:
    return load_pools(HOME)


def test_history_is_disjoint_from_the_future_and_keeps_its_mix(pools: dict) -> None:
    future = build_trace(pools, 200, seed=0)
    history = history_requests(pools, future, 300, seed=0)
    assert len(history) == 300
    assert not {r.item_id for r in history} & {r.item_id for r in future}
    asked = {r.question for r in future}
    assert not any(r.question in asked for r in history)  # disjoint by prompt text too, not only by id
    assert len({r.item_id for r in history}) == 300 and all(r.kind == "original" for r in history)
    assert Counter(r.source for r in history) == Counter(quotas(300, SHARES))
    assert [r.index for r in history] == list(range(300))
    assert history == history_requests(pools, future, 300, seed=0)  # seeded
    assert history != history_requests(pools, future, 300, seed=1)


def test_history_takes_what_is_left_where_a_source_runs_out(pools: dict) -> None:
    future = build_trace(pools, 200, seed=0)
    history = history_requests(pools, future, 2000, seed=0)
    unused = {s: sum(item.id not in {r.item_id for r in future} for item in pools[s]) for s in SHARES}
    got = Counter(r.source for r in history)
    for source, k in quotas(2000, SHARES).items():
        assert got[source] == min(k, unused[source])


def test_the_small_runs_ask_each_distinct_prompt_once(pools: dict) -> None:
    future = build_trace(pools, 120, seed=3)
    firsts = originals(future)
    assert len(firsts) == sum(r.kind == "original" for r in future) < len(future)
    assert len({r.item_id for r in firsts}) == len(firsts)
    assert {r.item_id for r in firsts} == {r.item_id for r in future}
    assert [r.index for r in firsts] == list(range(len(firsts))) and all(r.at == 0 for r in firsts)


def test_accuracy_by_source_and_points(pools: dict) -> None:
    firsts = originals(build_trace(pools, 60, seed=1))
    grades = [i % 3 != 0 for i in range(len(firsts))]
    grades[0] = None  # not gradable: left out
    got = by_source(firsts, grades)
    for source in SHARES:
        mine = [grades[r.index] for r in firsts if r.source == source and grades[r.index] is not None]
        assert got[source] == (round(sum(mine) / len(mine), 4) if mine else None)
    assert got["all"] == round(sum(g for g in grades if g is not None) / (len(grades) - 1), 4)
    keep = [r.source == "gsm8k" for r in firsts]
    assert set(k for k, v in by_source(firsts, grades, keep).items() if v is not None) <= {"gsm8k", "all"}
    assert _points(0.25, 0.375) == 12.5 and _points(None, 0.5) is None
