"""The engine against plain HF greedy decoding, plus its request lifecycle (stop, length, abort)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cpu_features import BF16_BATCH_VARIES

from engines.async_engine import AsyncEngine
from engines.engine import Engine, EngineConfig, RequestRejected
from engines.request import EngineRequest, FinishReason, RequestOutput
from engines.sampling import SamplingParams

QUESTIONS = ["Name the capital of France.", "Write a haiku about autumn leaves.", "Explain recursion briefly."]


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> Engine:
    return Engine.from_dir(smollm2_dir, dtype="fp32")


def run(engine: Engine, requests: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def chat(engine: Engine, question: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": question}])


def test_greedy_equals_transformers_generate(engine: Engine, smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for i, q in enumerate(QUESTIONS):
        prompt = chat(engine, q)
        expected = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=sorted(engine.tokenizer.eos_token_ids),
        )[0, len(prompt) :].tolist()
        outs = run(engine, [EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=24, temperature=0.0))])
        assert tokens(outs[f"r{i}"]) == expected


# 16 prompts from a few tokens to several hundred, so batches mix long chunked prefills with decodes.
BATCH_PROMPTS = [
    "Hi!",
    "What is 7 times 8?",
    "Name three primary colors.",
    "Translate 'good morning' into French.",
    "Write a haiku about the sea.",
    "What is the boiling point of water at sea level in Celsius?",
    "Give me two tips for staying focused while studying for exams.",
    "Explain in two sentences why the sky looks blue during the day.",
    "List the planets of the solar system in order from the sun.",
    "Summarize this: " + "The quick brown fox jumps over the lazy dog. " * 12,
    "What does a compiler do? Answer briefly.",
    "Write a Python function that returns the square of a number.",
    "Describe a cat to someone who has never seen one. " + "Be vivid and specific. " * 20,
    "Why do leaves change color in autumn?",
    "Tell me a short joke about programmers.",
    "Here are some notes: " + " ".join(f"item {i} costs {i * 3} dollars;" for i in range(60)) + " What is the total?",
]


def batched_and_alone(engine: Engine) -> tuple[list[list[int]], list[list[int]]]:
    """(one-at-a-time outputs, outputs of all 16 submitted together), greedy."""
    prompts = [chat(engine, q) for q in BATCH_PROMPTS]
    assert len(prompts) == 16 and max(map(len, prompts)) > 600 and min(map(len, prompts)) < 40
    params = SamplingParams(max_tokens=24, temperature=0.0)
    alone = [tokens(run(engine, [EngineRequest("a", p, params)])["a"]) for p in prompts]
    together = run(engine, [EngineRequest(str(i), p, params) for i, p in enumerate(prompts)])
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()
    return alone, [tokens(together[str(i)]) for i in range(16)]


@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=BF16_BATCH_VARIES), "fp32"])
def test_batched_greedy_equals_one_at_a_time(smollm2_dir: Path, dtype: str) -> None:
    # 128-token steps: the batch's 1,700 prompt tokens are chunked beside decodes, and the batched run
    # hits the prefix cache the one-at-a-time runs filled. Neither may change a single token, in bf16
    # too: every kernel the engine uses gives the same bits for a row however it is batched.
    engine = Engine.from_dir(smollm2_dir, dtype=dtype, config=EngineConfig(max_num_batched_tokens=128))
    alone, batched = batched_and_alone(engine)
    assert batched == alone
    assert engine.stats().prefix_hit_tokens > 0


@BF16_BATCH_VARIES
def test_prefix_cache_hit_gives_the_cold_output(smollm2_dir: Path) -> None:
    system = "You are a careful assistant for a hardware store. " + "Answer politely and precisely. " * 40
    questions = ["Do you sell hammers?", "What are your opening hours?"]
    cold = Engine.from_dir(smollm2_dir, dtype="bf16", config=EngineConfig(enable_prefix_caching=False))
    warm = Engine.from_dir(smollm2_dir, dtype="bf16")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    for i, q in enumerate(questions):
        prompt = cold.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
        expected = tokens(run(cold, [EngineRequest("c", prompt, params)])["c"])
        before = warm.stats().prefix_hit_tokens
        got = tokens(run(warm, [EngineRequest(f"w{i}", prompt, params)])[f"w{i}"])
        again = tokens(run(warm, [EngineRequest(f"again{i}", prompt, params)])[f"again{i}"])
        assert got == expected and again == expected
        hits = warm.stats().prefix_hit_tokens - before
        assert hits >= len(prompt) - 16  # the repeat hits all but the last partial block
        if i == 1:
            assert hits > 400  # the first question already cached the shared system prompt
    assert cold.stats().prefix_hit_tokens == 0


def test_streamed_text_is_the_decoded_output(engine: Engine) -> None:
    outs = run(engine, [EngineRequest("r", chat(engine, QUESTIONS[1]), SamplingParams(max_tokens=40, temperature=0))])[
        "r"
    ]
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(tokens(outs))
    assert [o.completion_tokens for o in outs] == list(range(1, len(outs) + 1))


def test_finish_reasons(engine: Engine) -> None:
    prompt = chat(engine, QUESTIONS[0])
    out = run(engine, [EngineRequest("eos", prompt, SamplingParams(max_tokens=50, temperature=0))])["eos"]
    assert out[-1].finish_reason is FinishReason.STOP and out[-1].new_token_ids[0] in engine.tokenizer.eos_token_ids
    out = run(engine, [EngineRequest("len", prompt, SamplingParams(max_tokens=3, temperature=0))])["len"]
    assert out[-1].finish_reason is FinishReason.LENGTH and out[-1].completion_tokens == 3
    out = run(engine, [EngineRequest("ign", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))])[
        "ign"
    ]
    assert out[-1].finish_reason is FinishReason.LENGTH and out[-1].completion_tokens == 12
    paris = engine.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    out = run(
        engine, [EngineRequest("tok", prompt, SamplingParams(max_tokens=50, temperature=0, stop_token_ids=(paris,)))]
    )["tok"]
    assert out[-1].finish_reason is FinishReason.STOP and tokens(out)[-1] == paris
    assert "Paris" not in "".join(o.text for o in out)
    out = run(engine, [EngineRequest("str", prompt, SamplingParams(max_tokens=50, temperature=0, stop=("of F",)))])[
        "str"
    ]
    assert out[-1].finish_reason is FinishReason.STOP and "".join(o.text for o in out) == "The capital "


def test_context_limit(smollm2_dir: Path) -> None:
    small = Engine.from_dir(smollm2_dir, dtype="bf16", config=EngineConfig(max_model_len=48))
    prompt = chat(small, QUESTIONS[2])  # 37 tokens
    with pytest.raises(RequestRejected, match="maximum context length is 48") as info:
        small.add_request(EngineRequest("x", prompt, SamplingParams(max_tokens=20)))
    assert info.value.code == "context_length_exceeded"
    out = run(small, [EngineRequest("fits", prompt, SamplingParams(max_tokens=48 - len(prompt), ignore_eos=True))])
    assert out["fits"][-1].finish_reason is FinishReason.LENGTH
    assert out["fits"][-1].completion_tokens == 48 - len(prompt)
    with pytest.raises(RequestRejected, match="empty"):
        small.check([], 1)
    with pytest.raises(RequestRejected, match=r"\[0, 49152\)"):
        small.check([1, 49152], 1)


def test_abort_frees_the_request(engine: Engine) -> None:
    engine.add_request(EngineRequest("gone", chat(engine, QUESTIONS[1]), SamplingParams(max_tokens=50)))
    engine.step()
    out = engine.abort("gone")
    assert out is not None and out.finish_reason is FinishReason.ABORT and out.completion_tokens == 1
    assert not engine.has_unfinished()
    assert engine.abort("gone") is None


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    prompt = chat(engine, QUESTIONS[1])
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=1234)
    first = tokens(run(engine, [EngineRequest("a", prompt, params)])["a"])
    assert first == tokens(run(engine, [EngineRequest("b", prompt, params)])["b"])


# --- the async wrapper -------------------------------------------------------------------------------


def test_async_engine_streams_and_aborts_when_the_caller_leaves(engine: Engine) -> None:
    async def main() -> None:
        runner = AsyncEngine(engine, name="t")
        runner.start()
        try:
            prompt = chat(engine, QUESTIONS[1])
            outs = [
                o
                async for o in runner.generate(
                    EngineRequest("full", prompt, SamplingParams(max_tokens=8, temperature=0))
                )
            ]
            assert outs[-1].finished and outs[-1].completion_tokens == 8
            async for out in runner.generate(EngineRequest("left", prompt, SamplingParams(max_tokens=500))):
                if out.completion_tokens >= 2:
                    break  # the generator is closed here: the request must be aborted
            for _ in range(200):
                if not engine.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            assert not engine.has_unfinished()
            many = [EngineRequest(f"m{i}", prompt, SamplingParams(max_tokens=4 + i, temperature=0)) for i in range(3)]
            async with runner.open(many) as stream:
                finals = {o.request_id: o for o in [o async for o in stream] if o.finished}
            assert {rid: o.completion_tokens for rid, o in finals.items()} == {"m0": 4, "m1": 5, "m2": 6}
        finally:
            runner.shutdown()

    asyncio.run(main())


def test_closing_a_stream_early_counts_every_generated_token(engine: Engine) -> None:
    async def main() -> None:
        runner = AsyncEngine(engine, name="t")
        runner.start()
        try:
            prompt = chat(engine, QUESTIONS[1])
            requests = [
                EngineRequest(f"c{i}", prompt, SamplingParams(max_tokens=500, ignore_eos=True)) for i in range(2)
            ]
            async with runner.open(requests) as stream:
                seen = [await stream.__anext__() for _ in range(2)]
                await asyncio.sleep(0.3)  # the engine keeps going: outputs pile up unread
            assert stream.pending == set()
            finals = stream.last
            assert all(o.finish_reason is FinishReason.ABORT for o in finals.values())
            read = sum(o.completion_tokens for o in seen)
            assert sum(o.completion_tokens for o in finals.values()) > read
            assert not engine.has_unfinished()
        finally:
            runner.shutdown()

    asyncio.run(main())


def test_async_engine_survives_a_failing_step(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step() -> list[RequestOutput]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)

    async def main() -> None:
        runner = AsyncEngine(engine, name="t")
        runner.start()
        try:
            prompt = chat(engine, QUESTIONS[0])
            outs = [o async for o in runner.generate(EngineRequest("x", prompt, SamplingParams(max_tokens=30)))]
            assert outs[-1].finish_reason is FinishReason.ERROR and "boom" in (outs[-1].error or "")
            again = [o async for o in runner.generate(EngineRequest("y", prompt, SamplingParams(max_tokens=3)))]
            assert again[-1].finish_reason is FinishReason.LENGTH
            assert runner.alive
        finally:
            runner.shutdown()

    asyncio.run(main())


def test_async_engine_shutdown_aborts_running_requests(engine: Engine) -> None:
    async def main() -> None:
        runner = AsyncEngine(engine, name="t")
        runner.start()
        prompt = chat(engine, QUESTIONS[1])
        outs = []
        async for out in runner.generate(EngineRequest("s", prompt, SamplingParams(max_tokens=500))):
            outs.append(out)
            if len(outs) == 2:
                await asyncio.to_thread(runner.shutdown)
        # a step already under way when shutdown came may still deliver its token first
        assert outs[-1].finish_reason is FinishReason.ABORT and outs[-1].new_token_ids == []
        assert outs[-1].completion_tokens == len(outs) - 1
        assert not engine.has_unfinished() and not runner.alive

    asyncio.run(main())
