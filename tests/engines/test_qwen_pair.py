"""The Qwen2.5-Coder pair the later tiers need: both fetch, load, and decode like transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.engine import Engine
from engines.request import EngineRequest
from engines.sampling import SamplingParams

QUESTION = [{"role": "user", "content": "Write a Python function that reverses a string."}]


def test_qwen_models_load_and_decode_like_transformers(qwen05_dir: Path) -> None:
    """The 0.5B in fp32 against transformers' Qwen2 class. The 1.5B is the same class and code path (only its
    sizes differ): its fp32 run against transformers cost 105 s of the suite (Xeon, 2 vCPUs; ~2.3x that on a Zen 3)
    and proved nothing the 0.5B does not; it is loaded, int8, and decoded in the speculative test below."""
    from transformers import AutoModelForCausalLM

    model_dir = qwen05_dir
    engine = Engine.from_dir(model_dir, dtype="fp32")
    prompt = engine.tokenizer.encode_chat(QUESTION)
    engine.add_request(EngineRequest("q", prompt, SamplingParams(max_tokens=8, temperature=0.0)))
    ours: list[int] = []
    while engine.has_unfinished():
        ours += [t for out in engine.step() for t in out.new_token_ids]
    del engine
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
    assert ours == expected


CODE_PROMPTS = [
    "Write a Python function that reverses a string.",
    "Rename the variable `x` to `count` in: def f(x):\n    return x + x * x",
    "What is 17 * 23? Answer with the number only.",
    "List three prime numbers greater than 50.",
    "Explain in one sentence what a hash map is.",
    "Fix the bug: for i in range(10) print(i)",
    "Write a SQL query selecting all rows of table users where age > 30.",
    "Translate to French: the cat sleeps on the mat.",
]


@pytest.fixture(scope="module")
def int8_pair(qwen_int8_pair: tuple[Path, Path]) -> tuple[Engine, object]:
    """The 1.5B target (an engine) and the 0.5B draft (a model), int8 as the tiers serve them on AVX2."""
    from engines.checkpoints.loader import load_model

    draft_dir, target_dir = qwen_int8_pair
    return Engine.from_dir(target_dir), load_model(draft_dir, "bf16")


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_greedy_equals_plain_greedy_on_the_qwen_pair(method: str, int8_pair: tuple[Engine, object]) -> None:
    """The 0.5B drafts for the 1.5B, or n-gram lookup: the output is the 1.5B's plain greedy output,
    token for token, on 8 prompts in one batch."""
    from engines.engine import EngineConfig
    from engines.speculative.speculator import SpeculativeConfig

    target, draft = int8_pair
    spec = SpeculativeConfig(method=method, adaptive=False, num_speculative_tokens=4)
    config = EngineConfig(kv_cache_bytes=64 << 20, speculative=spec)
    prompts = [target.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CODE_PROMPTS]

    def generate(engine: Engine) -> list[list[int]]:
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(f"{method}{i}", p, SamplingParams(max_tokens=24, temperature=0.0)))
        out: dict[str, list[int]] = {f"{method}{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        return list(out.values())

    engine = Engine(target.model, target.tokenizer, config, draft_model=draft if method == "draft" else None)
    speculative = generate(engine)
    stats = engine.stats().speculative
    assert speculative == generate(target)
    assert stats["spec_accepted"] > 0, stats
