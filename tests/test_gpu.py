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


@pytest.fixture(scope="module", params=["llama", "qwen2_moe", "mistral", "qwen3_moe", "gemma3"])
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


# bf16 is what the tiers serve on a GPU, and the one dtype the interpreter tests cannot run (they skip it):
# here every op's compiled kernel meets the torch reference at bf16 too, at the real models' widths.
OP_TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}  # relative to max |ref|


def close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    err = (ours.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= OP_TOLERANCE[dtype] * scale, f"{what}: max error {err:.3g} against max |ref| {scale:.3g}"


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_each_triton_op_meets_the_torch_reference_on_the_gpu(dtype: torch.dtype) -> None:
    from engines.kernels.backends import TorchBackend, TritonBackend
    from engines.kernels.quantize import quantize_int4, quantize_int8

    ours, ref = TritonBackend(), TorchBackend()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    for rows in (1, 7, 300):  # a decode row, a ragged batch, a prefill chunk; Qwen2.5-0.5B's widths
        x, residual, weight = rand(rows, 896), rand(rows, 896), rand(896)
        expected, expected_sum = ref.add_rms_norm(x, weight, 1e-6, residual.clone())
        got, got_sum = ours.add_rms_norm(x, weight, 1e-6, residual.clone())
        close(got, expected, dtype, f"add_rms_norm rows={rows}")
        close(got_sum, expected_sum, dtype, f"add_rms_norm residual rows={rows}")
        expected, _ = ref.add_rms_norm(x, weight, 1e-6, residual.clone(), offset=True)  # Gemma's (1 + w)
        got, _ = ours.add_rms_norm(x, weight, 1e-6, residual.clone(), offset=True)
        close(got, expected, dtype, f"add_rms_norm offset rows={rows}")
        gate_up = rand(rows, 2 * 4864)
        close(ours.silu_mul(gate_up, 4864), ref.silu_mul(gate_up, 4864), dtype, f"silu_mul rows={rows}")
        w = torch.randn(1152, 896, device="cuda", generator=gen)
        for qw in (quantize_int8(w), quantize_int4(w, 32)):
            kernel = ours.weight_kernel(qw, dtype)
            assert kernel is not None
            expected = x.float() @ qw.dequantize().T
            close(kernel(x, None), expected, dtype, f"{qw.format} matmul rows={rows}")


@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "mistral", "qwen3_moe", "gemma3"])
def test_bf16_hidden_states_on_the_triton_kernels_meet_the_torch_backend(arch: str, tmp_path: Path) -> None:
    """A prefill in bf16 on CUDA through every Triton kernel (attention over a chunked prompt, RoPE, norms,
    the fused MoE) ends in the torch backend's hidden state, within bf16's rounding."""
    from engines.kernels.backends import TorchBackend, use

    model_dir = tiny_hf_model(arch, tmp_path, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    prompt = [1 + (i * 37) % 300 for i in range(200)]  # two 128-token chunks below
    config = EngineConfig(kv_cache_bytes=1 << 24, max_num_batched_tokens=128)

    def final_hidden(engine: Engine) -> torch.Tensor:
        request = EngineRequest("h", prompt, SamplingParams(max_tokens=1), hidden_layer=4)
        (out,) = [o for o in _run(engine, request) if o.hidden is not None]
        return out.hidden

    triton_engine = Engine.from_dir(model_dir, dtype="bf16", config=config, device="cuda")
    assert type(triton_engine.runner.backend).__name__ == "TritonPagedAttention"
    ours = final_hidden(triton_engine)
    use("cuda", TorchBackend())
    try:
        reference = final_hidden(Engine.from_dir(model_dir, dtype="bf16", config=config, device="cuda"))
    finally:
        use("cuda", None)
    cosine = torch.nn.functional.cosine_similarity(ours.float(), reference.float(), dim=0).item()
    assert cosine > 0.999, cosine
    close(ours, reference, torch.bfloat16, "final hidden state")


def _run(engine: Engine, request: EngineRequest) -> list:
    engine.add_request(request)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


@cuda
def test_greedy_steps_take_the_argmax_on_the_gpu_and_others_sample_on_the_cpu(tiny_dir: Path) -> None:
    """Plain greedy steps move only the chosen ids off the GPU; a step holding a penalized row moves the
    logits and samples on the CPU. Both give the CPU engine's tokens, with graphs on."""

    def run(engine: Engine, penalized: bool) -> list[list[int]]:
        params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True) for _ in range(3)]
        if penalized:
            params[1] = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, frequency_penalty=1.5)
        for i, p in enumerate(params):
            engine.add_request(EngineRequest(f"g{i}", [3 + i, 40, 41, 42 + i], p))
        tokens: dict[str, list[int]] = {f"g{i}": [] for i in range(3)}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        return [tokens[f"g{i}"] for i in range(3)]

    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=16)
    cpu = Engine.from_dir(tiny_dir, dtype="fp32", config=config)
    gpu = Engine.from_dir(tiny_dir, dtype="fp32", config=config, device="cuda")
    for penalized in (False, True):
        assert run(gpu, penalized) == run(cpu, penalized)
    assert gpu.runner.graphs is not None and gpu.runner.graphs.steps > 0


def _logprob_run(engine: Engine, params: SamplingParams) -> tuple[list[int], list[float], list[list[int]]]:
    """Tokens, their logprobs and their top alternatives' ids, stepping the engine directly."""
    engine.add_request(EngineRequest("lp", list(range(3, 15)), params))
    tokens, logprobs, tops = [], [], []
    while engine.has_unfinished():
        for out in engine.step():
            for t in out.logprobs:
                tokens.append(t.token_id)
                logprobs.append(t.logprob)
                tops.append([i for i, _ in t.top])
    return tokens, logprobs, tops


@cuda
def test_logprobs_and_logit_bias_on_the_gpu_match_the_cpu(tiny_dir: Path) -> None:
    """Greedy steps with logprobs take the GPU's argmax path (only ids leave it) and still report the model's
    log-softmax; a logit bias sends the row to the CPU sampler. Both agree with the CPU engine."""
    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=16)
    cpu = Engine.from_dir(tiny_dir, dtype="fp32", config=config)
    gpu = Engine.from_dir(tiny_dir, dtype="fp32", config=config, device="cuda")
    plain = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    want, got = _logprob_run(cpu, plain), _logprob_run(gpu, plain)
    assert got[0] == want[0] and len(got[1]) == 6 and [top[0] for top in got[2]] == got[0]  # greedy: the argmax
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3
    banned = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True,
                            logit_bias=((want[0][0], -100.0),))  # fmt: skip
    biased_cpu, biased_gpu = _logprob_run(cpu, banned), _logprob_run(gpu, banned)
    assert biased_gpu[0] == biased_cpu[0] and biased_gpu[0][0] != want[0][0]


@cuda
@pytest.mark.parametrize("weights", [None, "int8"])
def test_adapters_on_the_gpu_take_the_triton_kernels_and_serve_each_sequence_its_cpu_tokens(
    tmp_path: Path, weights: str | None
) -> None:
    """Two LoRA adapters and the bare base in one batch on CUDA (the Triton shrink/expand): each sequence's greedy
    tokens are its own served alone on the GPU, and in fp32 the CPU engine's too (int8 runs other matmul kernels
    on the two devices: their last bits differ)."""
    from lora_adapters import make_adapter

    base = tiny_hf_model("qwen2", tmp_path / "qwen2", tie_word_embeddings=False)
    adapters = {name: make_adapter(base, tmp_path / name, seed) for seed, name in enumerate(("a", "b"), 1)}
    dtype = "fp32" if weights is None else "bf16"
    engines = {device: Engine.from_dir(base, dtype=dtype, weights=weights, device=device) for device in ("cpu", "cuda")}
    for engine in engines.values():
        for name, path in adapters.items():
            engine.load_adapter(name, path)
    prompts = [list(range(5, 25)), list(range(40, 47)), list(range(100, 133))]
    asks = [(f"p{i}-{n}", ids, n) for i, ids in enumerate(prompts) for n in ("a", "b", None)]

    def greedy(engine: Engine, part: list) -> dict[str, str]:
        requests = [EngineRequest(rid, ids, SamplingParams(max_tokens=8, temperature=0.0), adapter=n)
                    for rid, ids, n in part]  # fmt: skip
        return {c.request_id: c.text for c in complete_all(engine, requests)}

    together = greedy(engines["cuda"], asks)
    assert len(together) == len(asks) and len({together[f"p0-{n}"] for n in ("a", "b", None)}) == 3
    if weights is None:
        assert together == greedy(engines["cpu"], asks)
    for ask in asks:
        assert greedy(engines["cuda"], [ask])[ask[0]] == together[ask[0]], ask[0]
