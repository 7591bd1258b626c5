"""bench.savings: its trace is seeded and keeps the mix it promises; its grading, histogram and cross-check
helpers do what they say (the cross-check shown catching a planted error); the learned run's split and its
second-half scoring from the ledger's rows are what they say; and the whole bench runs end to
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
from bench.savings_grade import AMOUNTS, crosscheck, priced  # noqa: E402
from bench.savings_learned import (  # noqa: E402
    half_summaries,
    learned_keys,
    learning_notes,
    per_request,
    rebased,
    score_ratios,
    split_by_tenant,
)
from bench.savings_trace import (  # noqa: E402
    BURST_MAX,
    BURST_MIN,
    MAX_REPEAT_SHARE,
    TENANTS,
    Request,
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

    for given, runs in ((["--runs", "default"], ["large", "default"]), ([], ["large", "auto", "default", "learned"]),
                        (["--runs", "default", "large", "auto"], ["large", "auto", "default"]),
                        (["--runs", "learned"], ["large", "learned"])):  # fmt: skip
        monkeypatch.setattr(sys, "argv", ["bench.savings", *given])
        assert parse_args().runs == runs  # the baseline first, always
    monkeypatch.setattr(sys, "argv", ["bench.savings", "--runs", "large"])
    with pytest.raises(SystemExit):
        parse_args()
    assert "nothing to compare" in capsys.readouterr().err


def _request(index: int, tenant: str, at: float = 0.0) -> Request:
    return Request(index, tenant, at, 0, "fact", f"fact/{index}", "original", None,
                   [{"role": "user", "content": f"q{index}"}])  # fmt: skip


def test_the_learned_run_splits_each_tenants_own_traffic() -> None:
    tenants = ["saver", "saver", "quality", "saver", "balanced", "quality", "saver", "saver", "quality", "balanced"]
    trace = [_request(i, t, at=float(i)) for i, t in enumerate(tenants)]
    learn, score = split_by_tenant(trace)
    for part in (learn, score):
        assert [r.index for r in part] == sorted(r.index for r in part)  # trace order
    assert sorted(r.index for r in learn + score) == list(range(len(trace)))
    by = {t: [r.index for r in trace if r.tenant == t] for t in set(tenants)}
    for t, mine in by.items():  # the first half of the tenant's own requests learns (the smaller half when odd)
        assert [r.index for r in learn if r.tenant == t] == mine[: len(mine) // 2]
        assert [r.index for r in score if r.tenant == t] == mine[len(mine) // 2 :]
    assert [r.index for r in learn] == [0, 1, 2, 4]  # saver 5 → 2, quality 3 → 1, balanced 2 → 1
    assert [r.at for r in rebased(score)][:2] == [0.0, 2.0] and rebased(score)[0].index == 3  # arrivals from its first
    assert split_by_tenant([]) == ([], [])


def test_the_learned_run_is_scored_on_the_second_half_from_the_ledger() -> None:
    trace = [_request(i, t) for i, t in enumerate(["saver", "balanced", "saver", "balanced", "saver", "quality"])]
    _, score = split_by_tenant(trace)  # saver 2, 4; balanced 3; quality 5
    assert [r.index for r in score] == [2, 3, 4, 5]

    def run(prefix: str, tiers: list[str]) -> list[dict]:
        return [{"index": r.index, "tenant": r.tenant, "ok": True, "request_id": f"{prefix}{r.index}", "tier": tier,
                 "cache": "miss", "cascade": None} for r, tier in zip(trace, tiers, strict=True)]  # fmt: skip

    def row(rid: str, cost: str) -> dict:
        return {"request_id": rid, **dict.fromkeys(AMOUNTS, Decimal(0)), "cost": Decimal(cost),
                "counterfactual_cost": Decimal("1")}  # fmt: skip

    results = {
        "large": run("L", ["large"] * 6),
        "learned": run("N", ["large", "large", "large", "small", "tiny", "large"]),
    }
    results["learned"][3] |= {"ok": False, "request_id": None, "tier": None}  # a failed request: no row, wrong
    background = [row("N2-shadow", "0.7"), row("N4-explore", "0.3"), row("N5-explore-1", "0")]
    ledger = {"large": [row(f"L{i}", "1") for i in range(6)],
              "learned": [row(f"N{i}", c) for i, c in enumerate(["1", "1", "0.5", "9", "0.25", "1"]) if i != 3]
              + [*background, row("X9", "2")]}  # fmt: skip
    amounts, unclaimed = {}, {}
    for name in results:
        amounts[name], unclaimed[name] = per_request(results[name], ledger[name])
    assert amounts["learned"][2]["cost"] == Decimal("0.5") and amounts["learned"][3]["cost"] == 0
    assert unclaimed["learned"] == {"background_rows": 3, "background_cost": Decimal("1.0"), "unmatched_rows": 1}
    assert unclaimed["large"] == {"background_rows": 0, "background_cost": Decimal(0), "unmatched_rows": 0}
    grades = {"large": [True, True, True, True, False, True], "learned": [False, True, True, False, True, None]}
    halves = half_summaries(score, ["large", "learned"], results, grades, amounts)
    tenants = ("", "saver", "balanced", "quality")  # "": all
    assert set(halves) == {f"{r} (2nd half)/{t}" for r in ("large", "learned") for t in tenants}
    learned = halves["learned (2nd half)/"]
    assert (learned["requests"], learned["failed"], learned["graded"]) == (4, 1, 3)
    assert learned["cost"] == Decimal("1.75") and halves["large (2nd half)/"]["cost"] == 4  # 0.5 + 0 + 0.25 + 1
    assert halves["learned (2nd half)/saver"]["cost"] == Decimal("0.75")
    # accuracy: learned 2 of 3 graded (2, 3 failed, 4); large 3 of 4 → (2/3) / (3/4)
    assert score_ratios(halves, "learned") == (round((2 / 3) / 0.75, 4), round(1.75 / 4, 4))
    assert score_ratios(halves, "default") == (None, None)  # the run left out
    keys = learned_keys(halves, ["large", "learned"], learning_notes({}, {}), unclaimed["learned"])
    assert keys["learned_cost_ratio"] == 0.4375 and keys["default_cost_ratio_second_half"] is None
    assert keys["learned_large_share"] == 0.6667 and keys["learned_tiers"] == {"large": 0.6667, "tiny": 0.3333}
    # a gateway without the `learning` fields: nulls and zeros, no crash
    assert [keys[f"learned_{k}"] for k in ("explore_runs", "explore_cost_usd", "shadow_cost_usd")] == [0, 0, 0]
    assert keys["learned_active"] == dict.fromkeys(("saver", "balanced", "quality"))
    assert keys["learned_background_ledger"] == {"rows": 3, "cost_usd": 1.0, "unmatched_rows": 1}
    entry = {"learning": {"active": True, "threshold": 0.4, "verdicts": 7,
                          "explore": {"runs": 3, "cost_usd": "0.0125"}, "shadow": {"cost_usd": "0.5"}}}  # fmt: skip
    notes = learning_notes({"saver": entry}, {"saver": entry, "balanced": entry, "quality": {}})
    assert notes["active"] == {"saver": True, "balanced": None, "quality": None} and notes["threshold"]["saver"] == 0.4
    assert (notes["explore_runs"], notes["explore_cost_usd"], notes["shadow_cost_usd"]) == (6, 0.025, 1.0)
    assert learned_keys(halves, ["large"], {}, None)["learned_active"] is None


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
    for run in ("large", "auto", "default", "learned"):  # the learned run's two halves in one file
        assert len((tmp_path / f"{run}.jsonl").read_text().splitlines()) == 24
    assert (
        "| auto | saver |" in done.stdout
        and "| large | all |" in done.stdout
        and "| default | quality |" in done.stdout
        and "| learned (2nd half) | all |" in done.stdout
        and "| large (2nd half) | saver |" in done.stdout
    )
    # the learned run: scored on each tenant's second half against always-large on the same requests
    assert r["failed_learned"] == 0 and r["learned_cost_ratio"] > 0 and 0 <= r["learned_large_share"] <= 1
    assert r["default_cost_ratio_second_half"] is not None and set(r["learned_active"]) == set(TENANTS)
    assert r["learned_explore_runs"] >= 0 and r["learned_background_ledger"]["rows"] >= 0
