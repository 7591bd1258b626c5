"""The scheduler inside a real engine on a tiny random model: budgets, chunks, preemption, aborts, leaks."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engines.engine import Engine, EngineConfig
from engines.kv.cache import bytes_per_block
from engines.request import EngineRequest, FinishReason, RequestOutput
from engines.sampling import SamplingParams
from engines.scheduler import ScheduledBatch
from tiny import tiny_hf_model

BS = 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"), num_key_value_heads=2, head_dim=16)


def make_engine(tiny_dir: Path, *, num_blocks: int = 256, **config: object) -> Engine:
    per_block = bytes_per_block(3, 2, 16, BS, torch.float32)
    return Engine.from_dir(
        tiny_dir, dtype="fp32", config=EngineConfig(block_size=BS, kv_cache_bytes=num_blocks * per_block, **config)
    )


def record_steps(engine: Engine) -> list[ScheduledBatch]:
    """Every scheduled batch, as the runner saw it (ids and token counts copied at that moment)."""
    batches: list[ScheduledBatch] = []
    schedule = engine.scheduler.schedule

    def spy() -> ScheduledBatch:
        batch = schedule()
        batches.append(ScheduledBatch(list(batch.seqs), list(batch.num_new), list(batch.preempted)))
        return batch

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    return batches


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def words(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 319 + 1 for i in range(n)]


def drain(engine: Engine, on_step: Callable[[Engine], None] | None = None) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        if on_step:
            on_step(engine)
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def alone(tiny_dir: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = make_engine(tiny_dir)
    engine.add_request(EngineRequest("x", prompt, params))
    return tokens(drain(engine)["x"])


def assert_no_leaks(engine: Engine) -> None:
    bm = engine.block_manager
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert bm.num_free == bm.num_blocks and bm.stats().used == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    for h, block_id in bm._cached.items():
        assert bm.blocks[block_id].hash == h


def test_token_budget_chunks_long_prompts_and_mixes_decodes(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_num_batched_tokens=16)
    steps = record_steps(engine)
    prompts = {"a": words(40), "b": words(10, 50), "c": words(5, 90)}
    for rid, p in prompts.items():
        engine.add_request(EngineRequest(rid, p, greedy(3)))
    outs = drain(engine)
    plan = [[(s.request_id, n) for s, n in zip(b.seqs, b.num_new, strict=True)] for b in steps]
    assert plan[:4] == [
        [("a", 16)],
        [("a", 16)],
        [("a", 8), ("b", 8)],  # a's prompt ends; b starts in the same step
        [("a", 1), ("b", 2), ("c", 5)],  # a decodes beside b's last chunk and c's whole prompt
    ]
    assert all(sum(n for _, n in step) <= 16 for step in plan)
    for rid, p in prompts.items():  # chunking does not change what is generated
        assert tokens(outs[rid]) == alone(tiny_dir, p, greedy(3))
    assert_no_leaks(engine)


def test_max_num_seqs_caps_each_step(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_num_seqs=2)
    steps = record_steps(engine)
    for i in range(5):
        engine.add_request(EngineRequest(f"r{i}", words(6, 10 * i), greedy(4)))
    outs = drain(engine)
    assert max(len(b) for b in steps) == 2
    assert {rid: len(tokens(o)) for rid, o in outs.items()} == {f"r{i}": 4 for i in range(5)}
    assert_no_leaks(engine)


def test_priority_then_arrival_order(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_num_seqs=1)
    steps = record_steps(engine)
    engine.add_request(EngineRequest("late-low", words(5), greedy(2), priority=5))
    engine.add_request(EngineRequest("high", words(5, 20), greedy(2), priority=0))
    engine.add_request(EngineRequest("high-2", words(5, 40), greedy(2), priority=0))
    drain(engine)
    started = list(dict.fromkeys(s.request_id for b in steps for s in b.seqs))
    assert started == ["high", "high-2", "late-low"]


def test_preemption_recomputes_the_newest_and_changes_nothing(tiny_dir: Path) -> None:
    # 12 blocks of 4 tokens; each request needs 8 blocks at its longest: one fits, three do not.
    engine = make_engine(tiny_dir, num_blocks=12)
    steps = record_steps(engine)
    prompts = {f"r{i}": words(10, 30 * i) for i in range(3)}
    for rid, p in prompts.items():
        engine.add_request(EngineRequest(rid, p, greedy(20)))
    outs = drain(engine, on_step=lambda e: _check_refcounts(e))
    preempted = [s.request_id for b in steps for s in b.preempted]
    assert preempted and preempted[0] == "r2"  # the newest running request goes first
    assert engine.scheduler.num_preemptions == len(preempted)
    for rid, p in prompts.items():
        assert [o.finish_reason for o in outs[rid]][-1] is FinishReason.LENGTH
        assert tokens(outs[rid]) == alone(tiny_dir, p, greedy(20))
    assert_no_leaks(engine)


def _check_refcounts(engine: Engine) -> None:
    """Every referenced block belongs to a live sequence, exactly as often as it is referenced."""
    refs: dict[int, int] = {}
    for seq in engine.scheduler.running + engine.scheduler.waiting:
        for b in seq.block_table.block_ids:
            refs[b] = refs.get(b, 0) + 1
    assert {b.block_id: b.ref_count for b in engine.block_manager.blocks if b.ref_count} == refs


def test_a_request_larger_than_the_pool_is_refused_up_front(tiny_dir: Path) -> None:
    from engines.protocol import RequestRejected

    engine = make_engine(tiny_dir, num_blocks=4)  # 16 tokens
    with pytest.raises(RequestRejected, match="KV cache holds 16 tokens"):
        engine.add_request(EngineRequest("big", words(10), greedy(10)))


def test_abort_frees_blocks_at_once_running_or_waiting(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_num_seqs=1, enable_prefix_caching=False)
    engine.add_request(EngineRequest("run", words(9), greedy(50)))
    engine.add_request(EngineRequest("wait", words(9, 40), greedy(50)))
    engine.step()
    engine.step()
    assert engine.block_manager.stats().used == 3  # 10 tokens in blocks of 4
    out = engine.abort("run")
    assert out is not None and out.finish_reason is FinishReason.ABORT and out.completion_tokens == 2
    assert engine.block_manager.stats().used == 0
    assert engine.abort("wait") is not None and not engine.scheduler.waiting
    assert not engine.has_unfinished()
    assert_no_leaks(engine)


def test_a_prefix_hit_skips_the_cached_tokens_and_changes_nothing(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    steps = record_steps(engine)
    prompt = words(30)
    engine.add_request(EngineRequest("cold", prompt, greedy(6)))
    cold = tokens(drain(engine)["cold"])
    engine.add_request(EngineRequest("warm", prompt, greedy(6)))
    warm = tokens(drain(engine)["warm"])
    assert warm == cold
    first_warm = next(b for b in steps if b.seqs[0].request_id == "warm")
    assert first_warm.num_new == [2]  # 28 of 30 tokens were cached: 7 full blocks, the last one kept
    stats = engine.stats()
    assert stats.prefix_hit_tokens == 28 and stats.prefix_queried_tokens == 60
    engine.add_request(EngineRequest("other-tenant", prompt, greedy(6), cache_salt="tenant:2"))
    assert tokens(drain(engine)["other-tenant"]) == cold
    assert engine.stats().prefix_hit_tokens == 28  # a different salt never hits


def test_mixed_workload_leaves_no_blocks_behind(tiny_dir: Path) -> None:
    rng = random.Random(7)
    engine = make_engine(tiny_dir, num_blocks=24, max_num_batched_tokens=24, max_num_seqs=6)
    shared = words(12, 200)
    live: list[str] = []
    for i in range(40):
        prompt = (shared if rng.random() < 0.5 else []) + words(rng.randint(1, 20), rng.randint(1, 300))
        temp = rng.choice([0.0, 0.8])
        params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=temp, seed=i, ignore_eos=rng.random() < 0.5)
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
        live.append(f"r{i}")
        for _ in range(rng.randint(0, 3)):
            for o in engine.step():
                if o.finished:
                    live.remove(o.request_id)
            _check_refcounts(engine)
        if live and rng.random() < 0.2:
            engine.abort(live.pop(rng.randrange(len(live))))
            _check_refcounts(engine)
    drain(engine, on_step=_check_refcounts)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0 and stats.evictions > 0
    assert_no_leaks(engine)
