"""Training a LoRA adapter (`engines.lora.train`): PEFT trains it on transformers' model, our engine serves the
files, and the answer it was taught comes back on a prompt it never saw; a killed run resumes to the very weights
an uninterrupted one ends with; a checkpoint of other data is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engines.engine import Engine
from engines.lora.train import CHECKPOINT, Example, TrainConfig, train_adapter
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from tiny import tiny_hf_model

pytest.importorskip("peft")

ANSWER = [5, 6, 7, 8, 9, 10]
FAST = TrainConfig(rank=8, alpha=16, learning_rate=5e-3, epochs=6, accumulate=2, warmup_steps=2, patience=2)


def examples(n: int = 12) -> list[Example]:
    g = torch.Generator().manual_seed(0)
    return [Example(torch.randint(10, 200, (8,), generator=g).tolist(), ANSWER) for _ in range(n)]


def greedy(engine: Engine, prompt: list[int], adapter: str | None) -> list[int]:
    params = SamplingParams(max_tokens=len(ANSWER), temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(f"r-{adapter}", prompt, params, adapter=adapter))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_a_trained_adapter_teaches_the_answer_and_our_engine_serves_it(tmp_path: Path) -> None:
    base = tiny_hf_model("qwen2", tmp_path / "base")
    data = examples()
    said: list[str] = []
    result = train_adapter(base, data[:10], data[10:], tmp_path / "out", FAST, say=said.append)
    assert (result.adapter / "adapter_config.json").exists() and (result.adapter / "adapter_model.safetensors").exists()
    assert min(result.heldout_loss) < result.base_heldout_loss - 0.5
    assert result.heldout_loss[result.best_epoch - 1] == min(result.heldout_loss)
    assert any("held-out loss" in line for line in said) and any("examples/s" in line for line in said)
    engine = Engine.from_dir(base, dtype="fp32")
    engine.load_adapter("taught", result.adapter)
    unseen = data[11].prompt
    assert greedy(engine, unseen, "taught") == ANSWER
    assert greedy(engine, unseen, None) != ANSWER


RUN = """
import sys
sys.path[:0] = {paths!r}
from pathlib import Path
import test_lora_train as t
from engines.lora.train import train_adapter
data = t.examples(40)
train_adapter(Path({base!r}), data[:36], data[36:], Path({out!r}), t.SLOW, say=print)
"""
SLOW = TrainConfig(rank=4, alpha=8, learning_rate=1e-3, epochs=3, accumulate=1, save_every=2, patience=9)


def test_training_resumes_after_being_killed_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    base = tiny_hf_model("qwen2", tmp_path / "base")
    data = examples(40)
    whole = train_adapter(base, data[:36], data[36:], tmp_path / "whole", SLOW, say=lambda _: None)
    out = tmp_path / "killed"
    paths = [str(Path(__file__).parent), str(Path(__file__).parents[1]), str(Path(__file__).parents[2])]
    code = RUN.format(paths=paths, base=str(base), out=str(out))
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (out / CHECKPOINT).exists():
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:] if proc.stdout else ""
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not (out / "adapter").exists()  # killed mid-run, before the end
    said: list[str] = []
    resumed = train_adapter(base, data[:36], data[36:], out, SLOW, say=said.append)
    assert resumed.resumed_from > 0 and said[0].startswith(f"resuming at step {resumed.resumed_from} of ")
    assert resumed.steps == whole.steps and resumed.heldout_loss == whole.heldout_loss
    ours, theirs = (
        load_file(resumed.adapter / "adapter_model.safetensors"),
        load_file(whole.adapter / "adapter_model.safetensors"),
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_checkpoint_of_other_data_is_refused(tmp_path: Path) -> None:
    base = tiny_hf_model("qwen2", tmp_path / "base")
    data = examples(6)
    stopped = train_adapter(base, data[:5], data[5:], tmp_path / "out", SLOW, say=lambda _: None, stop_after_steps=2)
    assert stopped.steps == 2 and (tmp_path / "out" / CHECKPOINT).exists()
    with pytest.raises(ValueError, match="another run's"):
        train_adapter(base, data[1:], data[:1], tmp_path / "out", SLOW, say=lambda _: None)


def first_token_top(engine: Engine, prompt: list[int], adapter: str) -> dict[int, float]:
    """The first answer token's top-5 probabilities on our engine under `adapter`."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)
    engine.add_request(EngineRequest(f"top-{adapter}", prompt, params, adapter=adapter))
    tops: dict[int, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            for lp in out.logprobs:
                tops = {t: float(torch.tensor(v).exp()) for t, v in lp.top}
    return tops


def test_the_teachers_top_k_teaches_its_distribution_not_only_its_choice(tmp_path: Path) -> None:
    """The teacher puts 0.7 on the answer's token and 0.3 on another at every position: trained on its top-2
    (KL only), the student raises both, in about the teacher's odds; trained on the answers alone, only the choice.
    (A tiny random model's head spreads its mass over the whole vocabulary, so the odds are what is compared.)"""
    base = tiny_hf_model("qwen2", tmp_path / "base")
    alt = [t + 20 for t in ANSWER]
    odds = (float(torch.tensor(0.7).log()), float(torch.tensor(0.3).log()))
    top = tuple(((a, b), odds) for a, b in zip(ANSWER, alt, strict=True))
    data = [Example(e.prompt, e.answer, top) for e in examples()]
    ce_only = TrainConfig(rank=8, alpha=16, learning_rate=5e-3, epochs=8, accumulate=2, warmup_steps=2, patience=9,
                          top_weight=0.0)  # fmt: skip
    kl_only = TrainConfig(rank=8, alpha=16, learning_rate=5e-3, epochs=8, accumulate=2, warmup_steps=2, patience=9,
                          top_weight=1.0)  # fmt: skip
    ce = train_adapter(base, data[:10], data[10:], tmp_path / "ce", ce_only, say=lambda _: None)
    kl = train_adapter(base, data[:10], data[10:], tmp_path / "kl", kl_only, say=lambda _: None)
    engine = Engine.from_dir(base, dtype="fp32")
    engine.load_adapter("ce", ce.adapter)
    engine.load_adapter("kl", kl.adapter)
    unseen = data[11].prompt
    by_ce, by_kl = first_token_top(engine, unseen, "ce"), first_token_top(engine, unseen, "kl")
    assert max(by_kl, key=by_kl.get) == ANSWER[0] and max(by_ce, key=by_ce.get) == ANSWER[0]
    odds_kl = by_kl.get(alt[0], 0.0) / by_kl[ANSWER[0]]
    odds_ce = by_ce.get(alt[0], 0.0) / by_ce[ANSWER[0]]
    assert 0.2 < odds_kl < 1.0 and odds_ce < odds_kl / 2, (by_kl, by_ce)  # the teacher's odds: 0.3 / 0.7 = 0.43
