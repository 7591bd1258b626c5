"""bench.savings: its trace is seeded and keeps the mix it promises; its grading, histogram and cross-check
helpers do what they say (the cross-check shown catching a planted error); and the whole bench runs end to
end on the tiny profile at 24 requests (a gateway serving SmolLM2-135M as both tiers, a router trained on
the spot, PostgreSQL and Redis)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from decimal import Decimal
from itertools import pairwise
from pathlib import Path

import pytest

from gateway.cache.normalize import normalize_text
from policies.policy import Policy

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is no installed package: import it as `python -m bench.X` does
    sys.path.insert(0, str(ROOT))

from bench.savings_gateway import histogram_p50_ms  # noqa: E402
from bench.savings_grade import crosscheck, priced  # noqa: E402
from bench.savings_trace import (  # noqa: E402
    BURST_MAX,
    BURST_MIN,
    MAX_REPEAT_SHARE,
    TENANTS,
    build_trace,
    fact_items,
    load_pools,
)

HOME = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()


@pytest.fixture(scope="module")
def pools() -> dict:
    return load_pools(HOME)


def test_the_trace_is_seeded(pools: dict) -> None:
    first = [asdict(r) for r in build_trace(pools, 200, seed=3)]
    assert first == [asdict(r) for r in build_trace(pools, 200, seed=3)]
    other = [asdict(r) for r in build_trace(pools, 200, seed=4)]
    assert other != first
    assert [r["item_id"] for r in other] != [r["item_id"] for r in first]


def test_the_default_trace_keeps_its_mix(pools: dict) -> None:
    trace = build_trace(pools, 800, seed=0)
    n = len(trace)
    assert n == 800 and [r.index for r in trace] == list(range(n))
    sources = Counter(r.source for r in trace)
    assert sources["gsm8k"] >= n / 3 and sources["humaneval"] >= n / 4
    assert {"chat", "mtbench", "fact"} <= set(sources) and sum(sources.values()) == n
    variants = [r for r in trace if r.kind != "original"]
    assert 0.2 * n <= len(variants) <= MAX_REPEAT_SHARE * n
    assert {r.kind for r in variants} == {"repeat", "respace", "paraphrase"}
    for r in variants:  # each asks an earlier original again, graded the same way
        first = trace[r.of or 0]
        assert first.kind == "original" and first.index < r.index
        assert (r.item_id, r.source, r.grading, r.max_tokens) == (first.item_id, first.source, first.grading,
                                                                  first.max_tokens)  # fmt: skip
        same = normalize_text(r.question, masks=()) == normalize_text(first.question, masks=())
        assert same == (r.kind != "paraphrase"), (r.kind, r.question[:80], first.question[:80])
    originals = [r for r in trace if r.kind == "original"]
    assert len({r.item_id for r in originals}) == len(originals)  # an original is asked once
    assert set(Counter(r.tenant for r in trace)) == set(TENANTS) and min(Counter(r.tenant for r in trace).values()) > 80
    bursts = Counter(r.burst for r in trace)
    assert len(bursts) >= 20 and all(BURST_MIN <= size <= BURST_MAX for size in bursts.values())
    times = [r.at for r in trace]
    assert times == sorted(times)
    spans = [(min(r.at for r in trace if r.burst == b), max(r.at for r in trace if r.burst == b)) for b in bursts]
    assert all(a[1] < b[0] for a, b in pairwise(spans))  # one burst, then a quiet gap
    for r in trace:  # everything needed to grade it
        need = {"gsm8k": {"answer"}, "humaneval": {"prompt", "test", "entry_point"}, "fact": {"answer"}}
        assert need.get(r.source, set()) <= set(r.grading)
        assert r.messages[-1]["role"] == "user" and r.max_tokens > 0


def test_short_facts_are_distinct() -> None:  # their grading: tests/grading/test_facts.py
    facts = fact_items()
    assert len(facts) > 100 and len({f.question for f in facts}) == len(facts)


def test_runs_to_replay(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.savings import parse_args

    for given, runs in ((["--runs", "default"], ["large", "default"]), ([], ["large", "auto", "default"]),
                        (["--runs", "default", "large", "auto"], ["large", "auto", "default"])):  # fmt: skip
        monkeypatch.setattr(sys, "argv", ["bench.savings", *given])
        assert parse_args().runs == runs  # the baseline first, always
    monkeypatch.setattr(sys, "argv", ["bench.savings", "--runs", "large"])
    with pytest.raises(SystemExit):
        parse_args()
    assert "nothing to compare" in capsys.readouterr().err


def test_route_median_from_histogram_deltas() -> None:
    before = {"0.01": 2.0, "0.02": 2.0, "0.05": 2.0, "+Inf": 2.0}
    after = {"0.01": 3.0, "0.02": 7.0, "0.05": 10.0, "+Inf": 10.0}  # 8 new: 1 ≤ 10 ms, 4 in (10, 20], 3 in (20, 50]
    assert histogram_p50_ms(before, after) == pytest.approx(17.5)  # the 4th of 8: 3/4 into (10, 20]
    assert histogram_p50_ms(after, after) is None


def test_crosscheck_catches_a_misprice() -> None:
    policy = Policy()
    rows = [
        {"tier": "small", "prompt_tokens": 100, "cached_prompt_tokens": 40, "completion_tokens": 50,
         "draft_accepted": 0, "cache_status": "miss"},
        {"tier": "large", "prompt_tokens": 100, "cached_prompt_tokens": 0, "completion_tokens": 50,
         "draft_accepted": 0, "cache_status": "hit"},
    ]  # fmt: skip
    cost = priced(rows[0], policy)
    assert cost == (60 * Decimal("0.10") + 40 * Decimal("0.01") + 50 * Decimal("0.40")) / 1_000_000
    assert priced(rows[1], policy) == 0
    counterfactual = 2 * (100 * Decimal("0.50") + 50 * Decimal("2.00")) / 1_000_000
    levers = {"saved_cache": counterfactual / 2 + 40 * Decimal("0.09") / 1_000_000, "saved_speculation": Decimal(0),
              "saved_verifier": Decimal(0), "saved_policy": Decimal(0)}  # fmt: skip
    levers["saved_routing"] = counterfactual - cost - levers["saved_cache"]
    money = {"cost": cost, "counterfactual_cost": counterfactual, **levers}
    for r, share in zip(rows, (Decimal(1), Decimal(0)), strict=True):  # the ledger: money all on the first row
        r |= {k: v * share for k, v in money.items()}
    finance = {"t": {"requests": 2, **money}}
    assert crosscheck(finance, {"t": rows}, {"t": policy}) == []
    finance["t"]["cost"] += Decimal("0.000001")  # a misprice in the report
    problems = crosscheck(finance, {"t": rows}, {"t": policy})
    assert any("prices × tokens" in p for p in problems) and any("ledger" in p for p in problems)


@pytest.mark.slow
def test_savings_runs_end_to_end_on_the_tiny_profile(tmp_path: Path, postgres_server: str, redis_server: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SWITCHBOARD_TEST_POSTGRES_URL": postgres_server,
           "SWITCHBOARD_TEST_REDIS_URL": redis_server, "SWITCHBOARD_SHADOW_RUNS": "true"}  # fmt: skip
    cmd = [sys.executable, "-m", "bench.savings", "--profile", "tiny", "--requests", "24", "--max-tokens", "16",
           "--concurrency", "8", "--time-scale", "0", "--shadow-share", "1", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stderr[-4000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    keys = {"accuracy_ratio", "cost_ratio", "apgr", "apgr_ci_low", "route_p50_ms", "hit_rate", "saved_share"}
    assert keys | {f"saved_{lv}" for lv in ("cache", "routing", "speculation", "verifier", "policy")} <= set(r)
    assert (r["requests"], r["profile"], r["crosscheck"], r["failed_large"], r["failed_auto"]) == (
        24, "tiny", "ok", 0, 0)  # fmt: skip
    # the default run: every tenant on the built-in default policy, and the gateway's estimate per tenant
    assert r["failed_default"] == 0 and 0 < r["default_cost_ratio"] < 1 and 0 <= r["tiny_share"] <= 1
    assert set(r["estimated_quality_ratio"]) == {"saver", "balanced", "quality"}
    for found in r["estimated_quality_ratio"].values():
        assert set(found) == {"estimate", "low", "high", "judged", "graded"} and found["judged"] >= 0
    # every tiny- and small-served answer of the default run is shadow-run: the tenants have verdicts
    assert sum(found["judged"] for found in r["estimated_quality_ratio"].values()) >= 1
    assert 0 < r["cost_ratio"] < 1  # the small tier costs less, and a cache hit nothing
    assert r["accuracy_ratio"] is None or r["accuracy_ratio"] >= 0
    assert r["route_p50_ms"] is not None and r["route_p50_ms"] > 0
    assert r["saved_routing"] > 0 and r["saved_share"] > 0
    assert Path(r["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for run in ("large", "auto", "default"):
        assert len((tmp_path / f"{run}.jsonl").read_text().splitlines()) == 24
    assert (
        "| auto | saver |" in done.stdout
        and "| large | all |" in done.stdout
        and "| default | quality |" in done.stdout
    )
