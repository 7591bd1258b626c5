"""The backend interface: one place picks each op's implementation by device, and the whole model runs
through the Triton kernels (under the interpreter, on the CPU) with the torch reference's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton_support  # noqa: F401  (before any kernel module: TRITON_INTERPRET)

from engines.engine import Engine, EngineConfig
from engines.kernels.backends import CpuBackend, TorchBackend, TritonBackend, backend_for, use
from engines.offline import complete_all
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from tiny import tiny_hf_model


@pytest.fixture(scope="module", params=["llama", "qwen2_moe", "gemma3"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param))


def test_backends_are_picked_by_device_and_can_be_swapped() -> None:
    assert isinstance(backend_for(torch.zeros(1)), CpuBackend)
    assert isinstance(backend_for("cuda"), TritonBackend)  # by device type: no GPU needed to pick
    use("cpu", TorchBackend())
    try:
        assert backend_for(torch.zeros(1)).name == "torch"
    finally:
        use("cpu", None)
    assert backend_for("cpu").name == "cpu"


def answers(engine: Engine, n: int = 3, max_tokens: int = 5) -> list[str]:
    """Greedy answers of prompts of different lengths in one batch (prefill chunks beside decodes)."""
    prompts = [list(range(1 + i, 4 + 7 * i)) for i in range(n)]
    requests = [
        EngineRequest(f"r{i}", p, SamplingParams(max_tokens=max_tokens + i, temperature=0.0))
        for i, p in enumerate(prompts)
    ]
    done = {c.request_id: c.text for c in complete_all(engine, requests)}
    return [done[f"r{i}"] for i in range(n)]


def tiny_engine(model_dir: Path) -> Engine:
    return Engine.from_dir(model_dir, dtype="fp32", config=EngineConfig(kv_cache_bytes=1 << 21, block_size=8))


def generate(model_dir: Path, backend: TorchBackend) -> tuple[list[str], Engine]:
    """`answers` with all model code on `backend`; and the engine."""
    use("cpu", backend)
    try:
        engine = tiny_engine(model_dir)
        return answers(engine), engine
    finally:
        use("cpu", None)


def test_the_triton_backend_serves_the_torch_reference_tokens(tiny_dir: Path) -> None:
    from engines.models.moe import SparseMoE

    reference, torch_engine = generate(tiny_dir, TorchBackend())
    ours, triton_engine = generate(tiny_dir, TritonBackend())
    assert type(torch_engine.runner.backend).__name__ == "TorchPagedAttention"
    assert type(triton_engine.runner.backend).__name__ == "TritonPagedAttention"
    moes = [m for m in triton_engine.model.modules() if isinstance(m, SparseMoE)]
    assert all(hasattr(m, "_triton_stacked") for m in moes)  # the fused MoE kernel ran (MoE models)
    assert ours == reference and all(reference)


def test_the_triton_backend_serves_qwen3_moe_with_the_torch_reference_tokens(tmp_path: Path) -> None:
    """Qwen3-MoE on Triton: q/k norms through the Triton RMSNorm, 8 experts top-3 renormalised through the
    fused MoE, a dense `mlp_only_layers` layer (the fixture's models cover windows, GELU-tanh and scales)."""
    model_dir = tiny_hf_model("qwen3_moe", tmp_path)
    reference, _ = generate(model_dir, TorchBackend())
    ours, engine = generate(model_dir, TritonBackend())
    assert type(engine.runner.backend).__name__ == "TritonPagedAttention"
    assert ours == reference and all(reference)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_linears_take_the_device_backends_kernel(weights: str) -> None:
    from engines.kernels.quantize import quantize_int4, quantize_int8
    from engines.layers.linear import BackendKernel, Linear

    torch.manual_seed(0)
    w = torch.randn(48, 64)
    qw = quantize_int8(w) if weights == "int8" else quantize_int4(w, 32)
    x = torch.randn(3, 64)
    use("cpu", TritonBackend())
    try:
        layer = Linear(64, 48)
        layer.set_quantized(qw, torch.float32)
        assert isinstance(layer.kernel, BackendKernel) and layer.format == weights
        torch.testing.assert_close(layer(x), x @ qw.dequantize().T, rtol=1e-5, atol=1e-5)
    finally:
        use("cpu", None)
    default = Linear(64, 48)
    default.set_quantized(qw, torch.float32)
    assert not isinstance(default.kernel, BackendKernel) and default.format == weights  # the CPU kernels


def test_decode_from_the_graphs_static_buffers_serves_the_eager_tokens(tiny_dir: Path) -> None:
    """The CUDA-graph path's bookkeeping, without a GPU: decode steps run from `DecodeGraphs`' static
    buffers (five sequences padded to bucket 8, then fewer as they finish; padding rows on a scratch
    block; tables padded to the longest context) on the Triton backend, uncaptured, and give the tokens
    of the ordinary eager steps."""
    from engines.block_manager import BlockTable

    use("cpu", TritonBackend())
    try:
        reference = answers(tiny_engine(tiny_dir), n=5)
        engine = tiny_engine(tiny_dir)
        scratch = BlockTable("scratch")
        engine.block_manager.allocate(scratch, 1)  # a block that no sequence will ever be given
        engine.runner.enable_cuda_graphs(scratch.block_ids[0], -(-engine.max_model_len // 8), replay=False)
        served = answers(engine, n=5)
    finally:
        use("cpu", None)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.steps >= 8  # every decode step (prefills stay eager)
    assert served == reference and all(reference)
