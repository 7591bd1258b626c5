"""The quality gate: perplexity through the paged engine against transformers, GSM8K scoring, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engines.checkpoints.quality import perplexity, token_nll
from engines.engine import Engine, EngineConfig
from gateway.runtime import model_quality as quality
from gateway.runtime.model_quality import gsm8k_accuracy
from grading.answers import extract_answer, reference_answer
from tiny import tiny_hf_model

STREAM = torch.randint(1, 320, (300,), generator=torch.Generator().manual_seed(0)).tolist()
WINDOW, CHUNK = 160, 53  # two windows (160 + 140 tokens), chunks of 53, 53, 53 and a single token


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir: Path) -> Engine:
    return Engine.from_dir(tiny_dir, dtype="fp32", config=EngineConfig(kv_cache_bytes=1 << 22))


def hf_nll(model_dir: Path, ids: list[int], window: int, shift: int = 1) -> torch.Tensor:
    """Per-token NLL from plain transformers, window by window; `shift=2` scores the wrong targets."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for start in range(0, len(ids), window):
        w = torch.tensor(ids[start : start + window])
        with torch.no_grad():
            logits = hf(w[None]).logits[0].float()
        out.append(torch.nn.functional.cross_entropy(logits[:-shift], w[shift:], reduction="none"))
    return torch.cat(out)


def test_perplexity_equals_transformers(tiny_engine: Engine, tiny_dir: Path) -> None:
    free = tiny_engine.block_manager.num_free
    ours = token_nll(tiny_engine, STREAM, window=WINDOW, chunk=CHUNK)
    assert tiny_engine.block_manager.num_free == free  # every window's blocks are given back
    expected = hf_nll(tiny_dir, STREAM, WINDOW)
    assert ours.shape == expected.shape == (len(STREAM) - 2,)  # the first token of each window is context
    assert (ours - expected).abs().max().item() < 1e-4
    ppl = perplexity(tiny_engine, STREAM, window=WINDOW, chunk=CHUNK)
    assert ppl == pytest.approx(math.exp(expected.double().mean().item()), rel=1e-5)
    # The check can fail: the same comparison against targets shifted by one more position is far off.
    shifted = hf_nll(tiny_dir, STREAM, WINDOW, shift=2)
    assert (ours[: len(shifted)] - shifted).abs().max().item() > 0.1
    assert ppl != pytest.approx(math.exp(shifted.double().mean().item()), rel=1e-5)


def test_perplexity_is_deterministic_and_chunking_does_not_matter(tiny_engine: Engine) -> None:
    a = perplexity(tiny_engine, STREAM, window=WINDOW, chunk=CHUNK)
    assert perplexity(tiny_engine, STREAM, window=WINDOW, chunk=CHUNK) == a
    assert perplexity(tiny_engine, STREAM, window=WINDOW, chunk=WINDOW) == pytest.approx(a, rel=1e-5)
    assert perplexity(tiny_engine, STREAM, window=10_000, chunk=CHUNK) > 0  # capped at the model's context


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Janet sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18 every day.\nThe answer is 18.", "18"),
        ("The total is $1,234.50, so the answer is 1,234.50", "1234.5"),
        ("It takes 2/2=1 bolt, so 2+1 = 3 bolts in total.", "3"),
        ("The temperature dropped to -5 degrees.", "-5"),
        ("He ends with 70,000 dollars. The answer is 70000.00", "70000"),
        ("10-2=8", "8"),
        ("Token w12 and w3 are words, not numbers", None),
        ("I don't know.", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_reference_answer() -> None:
    assert reference_answer("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18") == "18"
    assert reference_answer("... #### 1,000") == "1000"
    assert reference_answer("no marker 12") is None


def test_gsm8k_accuracy_on_a_stub(tiny_engine: Engine) -> None:
    problems = [
        {"question": "w5 w6 w7", "answer": "w5 #### 5"},
        {"question": "w8 w9", "answer": "#### 1,000"},
        {"question": "w10", "answer": "#### 3"},
    ]
    accuracy, details = gsm8k_accuracy(tiny_engine, problems, max_tokens=8, batch=2)
    assert 0.0 <= accuracy <= 1.0
    assert [d["index"] for d in details] == [0, 1, 2]
    assert [d["reference"] for d in details] == ["5", "1000", "3"]
    for d in details:
        assert 1 <= d["completion_tokens"] <= 8 and d["finish_reason"] in ("stop", "length")
        assert isinstance(d["correct"], bool)
    assert accuracy == sum(d["correct"] for d in details) / 3
    assert not tiny_engine.has_unfinished()
    again, _ = gsm8k_accuracy(tiny_engine, problems, max_tokens=8, batch=16)  # greedy: batching changes nothing
    assert again == accuracy


def test_cli_models_eval_json(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from gateway.cli import main

    monkeypatch.setenv("SWITCHBOARD_HOME", str(tmp_path / "home"))
    # No data download here: the shipped text and problems are replaced by stubs in the tiny vocabulary.
    monkeypatch.setattr(quality, "heldout_text", lambda home, progress=True: " ".join(f"w{t}" for t in STREAM))
    stub = [{"question": "w1 w2", "answer": "#### 2"}, {"question": "w3", "answer": "#### 4"}, {"question": "w9"}]
    monkeypatch.setattr(quality, "load_gsm8k", lambda home, n, progress=True: stub[:n])
    assert main(["models", "eval", str(tiny_dir), "--gsm8k", "2", "--ppl-tokens", "256", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ppl_tokens"] == 256 and result["ppl_tokens_scored"] == 255  # one 256-token window
    assert result["perplexity"] > 1
    assert result["gsm8k_n"] == 2 and 0 <= result["gsm8k_accuracy"] <= 1
    assert result["weights"] == "bf16" and result["kv_cache_dtype"] == "auto"
    assert {"seconds", "ppl_seconds", "gsm8k_seconds", "gsm8k_correct"} <= result.keys()


@pytest.mark.slow
def test_smollm2_quality(smollm2_dir: Path) -> None:
    """The real data and model, kept small: held-out perplexity where SmolLM2 puts it, GSM8K runs end to end."""
    engine = Engine.from_dir(smollm2_dir, dtype="bf16")
    result = quality.evaluate(engine, smollm2_dir.parent.parent, ppl_tokens=1024, gsm8k=4, max_tokens=64)
    # Measured 12.4773, the same every run, on an AMD EPYC (avx512_bf16, no AMX), torch 2.13; fp32 gives
    # 12.4508 there. 5% leaves room for other CPUs' bf16 matmuls, twenty times the bf16-fp32 gap.
    assert result["perplexity"] == pytest.approx(12.48, rel=0.05)
    assert result["ppl_tokens"] == 1024 and result["gsm8k_n"] == 4
