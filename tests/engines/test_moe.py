"""MoE checkpoints built from dense ones: upcycled experts compute the dense model exactly, and a
split MLP whose experts all run adds back up to it; a split with K < E runs and is smaller per token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_models import run_in_pieces

from engines.checkpoints.loader import load_model
from engines.checkpoints.moe_build import build_moe
from engines.engine import Engine
from engines.models.config import ModelConfig
from engines.models.moe import SparseMoE
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from tiny import tiny_hf_model

IDS = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(3))
CALIBRATION = torch.randint(1, 320, (512,), generator=torch.Generator().manual_seed(4)).tolist()


def max_diff(dense_dir: Path, moe_dir: Path, ids: torch.Tensor = IDS) -> float:
    dense, moe = load_model(dense_dir, "fp32"), load_model(moe_dir, "fp32")
    cuts = [len(ids) // 3, 2 * len(ids) // 3]  # a prefill, an extend, then decodes
    return (run_in_pieces(moe, ids, cuts) - run_in_pieces(dense, ids, cuts)).abs().max().item()


@pytest.mark.parametrize(("arch", "moe_arch"), [("qwen2", "Qwen2MoeForCausalLM"), ("llama", "MixtralForCausalLM")])
def test_upcycled_moe_equals_the_dense_model(arch: str, moe_arch: str, tmp_path: Path) -> None:
    dense = tiny_hf_model(arch, tmp_path / "dense")
    build_moe(dense, tmp_path / "moe", experts=4, top_k=2, method="upcycle", progress=False)
    cfg = ModelConfig.from_dir(tmp_path / "moe")
    assert cfg.architecture == moe_arch and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    model = load_model(tmp_path / "moe", "fp32")
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    # The routers are random: tokens really do go to different experts.
    x = torch.randn(64, cfg.hidden_size)
    assert len(torch.unique(model.layers[0].mlp.route(x)[1])) == 4
    assert max_diff(dense, tmp_path / "moe") < 1e-4
    # The check can fail: perturb one expert and the MoE is no longer the dense model.
    broken = load_model(tmp_path / "moe", "fp32")
    broken.layers[0].mlp.experts[1].down_proj.weight.data.mul_(1.5)
    diff = (run_in_pieces(broken, IDS, [17, 29]) - run_in_pieces(load_model(dense, "fp32"), IDS, [17, 29])).abs().max()
    assert diff > 1e-3


def test_upcycled_smollm2_equals_dense_smollm2(smollm2_dir: Path, tmp_path: Path) -> None:
    build_moe(smollm2_dir, tmp_path / "moe", experts=4, top_k=2, method="upcycle", progress=False)
    from engines.tokenizer import Tokenizer

    ids = torch.tensor(Tokenizer(smollm2_dir).encode("def fibonacci(n):\n    if n < 2:\n        return n\n"))
    assert max_diff(smollm2_dir, tmp_path / "moe", ids) < 1e-4


def test_split_with_every_expert_running_is_the_dense_mlp(tmp_path: Path) -> None:
    dense = tiny_hf_model("qwen2", tmp_path / "dense")
    report = build_moe(
        dense,
        tmp_path / "all",
        experts=4,
        top_k=4,
        method="split",
        shared=32,
        calibration_ids=CALIBRATION,
        progress=False,
    )
    assert report is not None and report.active_mlp_fraction == 1.0 and report.router_recall == 1.0
    cfg = ModelConfig.from_dir(tmp_path / "all")
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.moe_weighting) == (32, 32, "none")
    assert max_diff(dense, tmp_path / "all") < 1e-4  # the partitions add back up to the MLP


def test_split_runs_fewer_neurons_and_serves(tmp_path: Path) -> None:
    dense = tiny_hf_model("qwen2", tmp_path / "dense")
    report = build_moe(
        dense, tmp_path / "moe", experts=4, top_k=1, method="split", calibration_ids=CALIBRATION, progress=False
    )
    assert report is not None and report.active_mlp_fraction == 0.25
    # Chance is 0.25 (top-1 of 4 experts); this split's router measured 0.5964, the same every run (seeded
    # model, calibration and k-means) on an AMD EPYC (avx512_bf16, no AMX), torch 2.13, scikit-learn's KMeans.
    assert report.router_recall == pytest.approx(0.5964, abs=0.05)
    engine = Engine.from_dir(tmp_path / "moe", dtype="fp32")
    engine.add_request(
        EngineRequest("m", list(range(1, 20)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    )
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert len(out) == 8
    assert max_diff(dense, tmp_path / "moe") > 1e-3  # a real approximation, not the dense model


def test_moe_build_refuses_bad_arguments(tmp_path: Path) -> None:
    dense = tiny_hf_model("qwen2", tmp_path / "dense")
    with pytest.raises(ValueError, match="top-k"):
        build_moe(dense, tmp_path / "x", experts=4, top_k=5, method="upcycle", progress=False)
    with pytest.raises(ValueError, match="does not split"):
        build_moe(dense, tmp_path / "x", experts=3, top_k=1, method="split", shared=0, progress=False)
