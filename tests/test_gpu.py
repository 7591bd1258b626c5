"""The CUDA path: engines on a GPU with the Triton backend and CUDA graphs. Skipped without CUDA (these
machines have none; the kernels themselves are proven under the Triton interpreter in test_triton_*)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.cuda_graphs import BUCKETS, bucket_for
from engines.engine import Engine, EngineConfig
from engines.offline import complete_all
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from tiny import tiny_hf_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none")


def test_decode_steps_take_the_smallest_bucket_that_holds_them() -> None:
    assert [bucket_for(n) for n in (1, 2, 3, 5, 17, 128)] == [1, 2, 4, 8, 24, 128]
    assert bucket_for(BUCKETS[-1] + 1) is None  # above the largest: the eager forward


@pytest.fixture(scope="module", params=["llama", "qwen2_moe"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param))


def answers(engine: Engine, n: int = 6) -> list[str]:
    """Greedy answers to prompts of different lengths, all in one batch."""
    prompts = [list(range(1 + i, 4 + 5 * i)) for i in range(n)]
    requests = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.0)) for i, p in enumerate(prompts)]
    done = {c.request_id: c.text for c in complete_all(engine, requests)}
    return [done[f"r{i}"] for i in range(n)]


@cuda
def test_a_gpu_engine_serves_the_cpu_reference_tokens_with_and_without_graphs(tiny_dir: Path) -> None:
    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=16)
    reference = answers(Engine.from_dir(tiny_dir, dtype="fp32", config=config))
    graphs = Engine.from_dir(tiny_dir, dtype="fp32", config=config, device="cuda")
    eager = Engine.from_dir(
        tiny_dir, dtype="fp32", config=EngineConfig(kv_cache_bytes=1 << 22, cuda_graphs=False), device="cuda"
    )
    assert type(graphs.runner.backend).__name__ == "TritonPagedAttention"
    assert graphs.runner.graphs is not None  # captured, the fused MoE's too (it never syncs with the host)
    assert answers(graphs) == reference == answers(eager)


@cuda
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_on_the_gpu_use_the_triton_matmuls(tiny_dir: Path, weights: str) -> None:
    from engines.layers.linear import BackendKernel, Linear

    engine = Engine.from_dir(tiny_dir, dtype="bf16", weights=weights, device="cuda")
    kernels = [m.kernel for m in engine.model.modules() if isinstance(m, Linear) and m.kernel is not None]
    assert kernels and all(isinstance(k, BackendKernel) for k in kernels)
    assert all(answers(engine))
