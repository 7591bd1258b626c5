"""Distilling a draft toward its target: the KL falls, an interrupted run resumes, the result drafts."""

from __future__ import annotations

from pathlib import Path

import torch

from engines.engine import Engine, EngineConfig
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from engines.speculative.distill import STATE, DistillConfig, distill
from engines.speculative.speculator import SpeculativeConfig
from tiny import tiny_hf_model

CORPUS = torch.randint(1, 320, (12 * 48,), generator=torch.Generator().manual_seed(5)).tolist()


def test_distill_lowers_the_kl_resumes_and_drafts(tmp_path: Path) -> None:
    teacher = tiny_hf_model("qwen2", tmp_path / "teacher")
    student = tmp_path / "student"
    torch.manual_seed(9)
    tiny_hf_model("qwen2", student, num_hidden_layers=2)
    cfg = DistillConfig(steps=4, window=48, top_k=16, lr=3e-3, train_layers=2, save_every=2, eval_windows=2)
    first = distill(student, teacher, tmp_path / "out", cfg, corpus_ids=CORPUS, progress=False)
    assert (tmp_path / "out" / STATE).is_file()
    # Resume: a longer run continues from the saved step instead of starting over.
    longer = DistillConfig(**{**cfg.__dict__, "steps": 8})
    summary = distill(student, teacher, tmp_path / "out", longer, corpus_ids=CORPUS, progress=False)
    assert summary["steps"] == 8 and first["steps"] == 4
    assert summary["kl_after"] < summary["kl_before"] == first["kl_before"]  # held-out windows, fixed
    # The distilled checkpoint is a draft for the teacher: greedy output is still the teacher's own.
    plain = Engine.from_dir(teacher, dtype="fp32")
    spec = EngineConfig(speculative=SpeculativeConfig(method="draft", adaptive=False))
    drafted = Engine.from_dir(teacher, dtype="fp32", config=spec, draft_dir=tmp_path / "out")
    outs = []
    for engine in (plain, drafted):
        engine.add_request(
            EngineRequest("d", CORPUS[:12], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        )
        tokens: list[int] = []
        while engine.has_unfinished():
            tokens += [t for o in engine.step() for t in o.new_token_ids]
        outs.append(tokens)
    assert outs[0] == outs[1]
    assert drafted.stats().speculative["spec_proposed"] > 0
