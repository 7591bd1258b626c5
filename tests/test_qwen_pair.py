"""The Qwen2.5-Coder pair the later tiers need: both fetch, load, and decode like transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.engine import Engine
from engines.request import EngineRequest
from engines.sampling import SamplingParams

QUESTION = [{"role": "user", "content": "Write a Python function that reverses a string."}]


@pytest.mark.parametrize("fixture", ["qwen05_dir", "qwen15_dir"])
def test_qwen_models_load_and_decode_like_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM

    model_dir: Path = request.getfixturevalue(fixture)
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
