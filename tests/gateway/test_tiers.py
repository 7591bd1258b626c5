"""Tiers: profiles, one KV budget shared by every tier's engine, and a tier drafting for another."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from core.settings import Settings
from engines.engine import Engine, EngineConfig
from engines.kv.budget import KVBudget
from engines.kv.cache import bytes_per_block
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from gateway.runtime.tiers import load_engines
from tiny import tiny_hf_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiers")
    return tiny_hf_model("qwen2", root / "small"), tiny_hf_model(
        "qwen2", root / "large", hidden_size=96, num_hidden_layers=4
    )


def test_profiles() -> None:
    s = Settings()
    assert {n: (t.model, t.weights) for n, t in s.tiers.items()} == {
        "tiny": ("smollm2-135m-instruct", "int8"),
        "small": ("qwen2.5-coder-0.5b-instruct", "int8"),
        "large": ("qwen2.5-coder-1.5b-instruct", "int8"),
    }
    assert all(t.kv_cache_bytes is None for t in s.tiers.values())  # all draw on the shared pool
    assert list(Settings(profile="tiny").tiers) == ["small"]
    with pytest.raises(ValidationError, match="draft_tier"):
        Settings(tiers={"large": {"speculative": "draft", "draft_tier": "nope"}})


def test_tiers_share_one_budget_and_a_draft_tier_drafts(pair: tuple[Path, Path], tmp_path: Path) -> None:
    small, large = pair
    settings = Settings(
        home=tmp_path,
        kv_pool_bytes="4MiB",
        tiers={
            "small": {"model": str(small), "dtype": "fp32"},
            "large": {"model": str(large), "dtype": "fp32", "speculative": "draft", "draft_tier": "small"},
            "private": {"model": str(small), "dtype": "fp32", "kv_cache_bytes": "1MiB"},
        },
    )
    engines = load_engines(settings)
    s, big, own = engines["small"].engine, engines["large"].engine, engines["private"].engine
    assert s.kv_budget is not None and s.kv_budget is big.kv_budget and own.kv_budget is None
    assert big.speculator is not None and big.speculator.proposer.model is s.model  # weights in memory once
    assert big.speculator.proposer.block_manager.budget is s.kv_budget  # the draft's KV counts too


def run_in_thread(engine: Engine, requests: list[EngineRequest], log: list[tuple[float, int]]) -> threading.Thread:
    def loop() -> None:
        for r in requests:
            engine.add_request(r)
        while engine.has_unfinished():
            outs = engine.step()
            log.append((time.monotonic(), sum(len(o.new_token_ids) for o in outs)))

    thread = threading.Thread(target=loop)
    thread.start()
    return thread


def test_two_tiers_under_load_share_the_pool_without_starving(pair: tuple[Path, Path]) -> None:
    small, large = pair
    cfg = Engine.from_dir(large, dtype="fp32").model.config
    per_block_l = bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, torch.float32)
    budget = KVBudget(40 * per_block_l)
    config = EngineConfig(block_size=4, max_num_seqs=16, enable_prefix_caching=False)
    a = Engine.from_dir(small, dtype="fp32", config=config, name="small", kv_budget=budget)
    b = Engine.from_dir(large, dtype="fp32", config=config, name="large", kv_budget=budget)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def reqs(tag: str, n: int) -> list[EngineRequest]:
        return [EngineRequest(f"{tag}{i}", [(i * 7 + j) % 300 + 1 for j in range(20)], params) for i in range(n)]

    # Alone, a busy tier may use far more than half of the budget: nothing is split in advance.
    peak = 0
    for r in reqs("solo", 12):
        b.add_request(r)
    while b.has_unfinished():
        b.step()
        peak = max(peak, budget.by_owner["large"])
    assert peak > 0.75 * budget.total_bytes
    assert budget.used_bytes == 0  # everything came back
    # Together, under more load than fits: both finish, both make progress while the other runs,
    # and the budget holds (give or take one step's blocks from the race between the two threads).
    log_a: list[tuple[float, int]] = []
    log_b: list[tuple[float, int]] = []
    most = 0
    threads = [run_in_thread(a, reqs("a", 16), log_a), run_in_thread(b, reqs("b", 16), log_b)]
    while any(t.is_alive() for t in threads):
        most = max(most, budget.used_bytes)
        time.sleep(0.001)
    for t in threads:
        t.join()
    assert sum(n for _, n in log_a) == 16 * 24 and sum(n for _, n in log_b) == 16 * 24
    assert most <= budget.total_bytes + 16 * per_block_l
    both_running = min(log_a[-1][0], log_b[-1][0])
    assert sum(n for t, n in log_a if t < both_running) > 0 and sum(n for t, n in log_b if t < both_running) > 0
    assert budget.used_bytes == 0
