"""Prefill-only requests that return a prompt's hidden state (the router's feature from the serving tier):
against HF transformers' `hidden_states`, the same from the prefix cache as cold, inside a batch as alone,
and their prompt left in the prefix cache for the generation that follows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.engine import Engine, EngineConfig, RequestRejected
from engines.request import EngineRequest, FinishReason, RequestOutput
from engines.sampling import SamplingParams

QUESTION = "A farmer has 17 sheep and buys 5 more, then sells 8. How many sheep does the farmer have now?"
LONG = "Summarize the following notes. " + " ".join(f"Note {i}: the meeting moved to room {i + 3}." for i in range(12))


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> Engine:
    return Engine.from_dir(smollm2_dir, dtype="fp32", config=EngineConfig(max_num_batched_tokens=64))


def prompt(engine: Engine, question: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": question}])


def run(engine: Engine, requests: list[EngineRequest]) -> dict[str, RequestOutput]:
    """Each request's final output."""
    for r in requests:
        engine.add_request(r)
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            last[out.request_id] = out
    return last


def hidden(engine: Engine, ids: list[int], layer: int, rid: str = "h", salt: str = "") -> RequestOutput:
    req = EngineRequest(rid, ids, SamplingParams(max_tokens=1), cache_salt=salt, hidden_layer=layer)
    return run(engine, [req])[rid]


@pytest.mark.parametrize("layer", [0, 7, 29])
def test_hidden_state_equals_transformers(engine: Engine, smollm2_dir: Path, layer: int) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = prompt(engine, LONG)  # longer than a 64-token chunk: the state comes from the prompt's last chunk
    assert len(ids) > 64
    with torch.no_grad():
        expected = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[layer][0, -1]
    out = hidden(engine, ids, layer, salt=f"hf{layer}")
    assert out.finish_reason == FinishReason.STOP and out.completion_tokens == 0 and out.new_token_ids == []
    assert out.hidden is not None and out.hidden.shape == expected.shape
    torch.testing.assert_close(out.hidden, expected, atol=2e-3, rtol=2e-3)


def test_hidden_state_is_the_same_from_the_prefix_cache(engine: Engine) -> None:
    ids = prompt(engine, LONG)
    cold = hidden(engine, ids, 20, rid="cold", salt="prefix-test")
    assert cold.cached_tokens == 0
    warm = hidden(engine, ids, 20, rid="warm", salt="prefix-test")
    assert warm.cached_tokens >= len(ids) - engine.config.block_size  # all but the last partial block
    torch.testing.assert_close(warm.hidden, cold.hidden, atol=1e-4, rtol=1e-4)


def test_prefill_only_request_leaves_its_prompt_for_the_generation(engine: Engine) -> None:
    ids = prompt(engine, LONG)
    hidden(engine, ids, 10, rid="route", salt="tenant-a")
    gen = run(engine, [EngineRequest("gen", ids, SamplingParams(max_tokens=4, temperature=0.0), cache_salt="tenant-a")])
    bs = engine.config.block_size
    assert gen["gen"].cached_tokens == (len(ids) - 1) // bs * bs  # every full block: no second prefill
    other = run(engine, [EngineRequest("other", ids, SamplingParams(max_tokens=1), cache_salt="tenant-b")])
    assert other["other"].cached_tokens == 0  # another tenant's salt sees none of it


def test_hidden_state_in_a_batch_equals_alone(engine: Engine) -> None:
    a, b = prompt(engine, QUESTION), prompt(engine, LONG)
    alone = hidden(engine, a, 15, rid="alone", salt="batch-alone")
    gens = [
        EngineRequest(f"g{i}", b, SamplingParams(max_tokens=6, temperature=0.0), cache_salt="batch") for i in range(3)
    ]
    plain = run(engine, [EngineRequest("p", b, SamplingParams(max_tokens=6, temperature=0.0), cache_salt="solo")])["p"]
    both = run(
        engine, [*gens, EngineRequest("h", a, SamplingParams(max_tokens=1), cache_salt="batch-mixed", hidden_layer=15)]
    )
    torch.testing.assert_close(both["h"].hidden, alone.hidden, atol=1e-4, rtol=1e-4)
    assert all(both[f"g{i}"].completion_tokens == 6 for i in range(3))
    assert plain.completion_tokens == 6
    assert not engine.has_unfinished()


def test_hidden_layer_out_of_range_is_rejected(engine: Engine) -> None:
    ids = prompt(engine, QUESTION)
    with pytest.raises(RequestRejected, match="hidden_layer"):
        engine.add_request(EngineRequest("bad", ids, SamplingParams(max_tokens=1), hidden_layer=31))


def test_async_engine_hidden_state_equals_the_engine(engine: Engine) -> None:
    import asyncio

    from engines.async_engine import AsyncEngine

    ids = prompt(engine, QUESTION)
    expected = hidden(engine, ids, 12, rid="sync", salt="async-a").hidden
    runner = AsyncEngine(engine, name="small")
    runner.start()
    try:
        got = asyncio.run(runner.hidden_state(ids, 12, cache_salt="async-b"))
        with pytest.raises(RuntimeError, match="no hidden state"):
            asyncio.run(runner.hidden_state(ids, 99))  # out of range: the engine rejects it
    finally:
        runner.shutdown()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
