"""Each family the engine serves against transformers' own class for it, on a tiny random config with
every structural switch on (tests/tiny.py `FAMILY_DEFAULTS`): Llama 3 (llama3 RoPE, tied head, three end
ids), Mistral (sliding window 12 < the prompts), Qwen3 (q/k norm; and YaRN), Qwen3-MoE (8 experts top-3
renormalised, a dense `mlp_only_layers` layer), Gemma 3 (windowed and global layers with their own RoPE,
(1 + w) norms, GELU-tanh, query scale, soft-capped logits).

Logits through the paged cache (a prefill, a chunk over cached blocks, decodes over ≥ 3 blocks; a batch
mixing decodes with chunks) in fp32 on the torch reference and on our CPU library's attention; bf16 close to
transformers' own bf16; 32 greedy tokens through the engine (prefix cache, batching) equal to `generate`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.model_checks import logits_in_pieces
from engines.checkpoints.loader import load_model
from engines.engine import Engine, EngineConfig
from engines.kernels import cpu_attention, cpu_ops
from engines.kernels.reference import TorchPagedAttention
from engines.kv.cache import PagedKVCache
from engines.model_runner import Chunk, ModelRunner
from engines.models.config import ModelConfig, UnsupportedModelError
from engines.models.llama import LlamaForCausalLM
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from tiny import tiny_hf_model

FAMILIES = ["llama3", "mistral", "qwen3", "qwen3_yarn", "qwen3_moe", "gemma3"]
BLOCK = 4


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param))


def hf_logits(path: Path, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def new_cache(model: LlamaForCausalLM, blocks: int) -> PagedKVCache:
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, blocks, BLOCK, model.dtype)
    cache.zero_blocks(list(range(blocks)))
    return cache


def pieces(model: LlamaForCausalLM, ids: torch.Tensor, native: bool) -> torch.Tensor:
    """Every position's logits: a prefill of 17, a chunk of 12 over those cached blocks, then decodes, on
    our CPU library's attention or the torch reference."""
    backend = cpu_attention.NativePagedAttention if native else TorchPagedAttention
    return logits_in_pieces(model, ids, [17, 29], BLOCK, backend)


IDS = torch.randint(1, 320, (40,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_fp32_logits_equal_transformers(family_dir: Path, native: bool) -> None:
    if native and not cpu_ops.usable(torch.empty(0), 16):
        pytest.skip("our CPU library does not build here")
    model = load_model(family_dir, "fp32")
    assert any(model.config.windows) == (family_dir.name.startswith(("mistral", "gemma3")))
    with torch.inference_mode():
        got = pieces(model, IDS, native)
    assert (got - hf_logits(family_dir, IDS)).abs().max().item() < 1e-4


def test_a_batch_of_mixed_lengths_equals_each_alone(family_dir: Path) -> None:
    """One step carrying a decode, a fresh prefill and a chunk after a cached prefix: each sequence's
    logits are transformers' on that sequence alone."""
    model = load_model(family_dir, "fp32")
    runner = ModelRunner(model, new_cache(model, 40))
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(1, 320, (n,), generator=gen) for n in (22, 13, 31)]
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    with torch.inference_mode():  # the first and third sequences' prefixes go in first
        runner.forward([Chunk(seqs[0][:21].tolist(), 0, tables[0]), Chunk(seqs[2][:9].tolist(), 0, tables[2])])
        logits = runner.forward(
            [
                Chunk(seqs[0][21:].tolist(), 21, tables[0]),
                Chunk(seqs[1].tolist(), 0, tables[1], num_logits=13),
                Chunk(seqs[2][9:].tolist(), 9, tables[2], num_logits=22),
            ]
        )
    expected = [hf_logits(family_dir, s) for s in seqs]
    got = logits.split([1, 13, 22])
    for g, e in zip(got, [expected[0][-1:], expected[1], expected[2][9:]], strict=True):
        assert (g - e).abs().max().item() < 1e-4


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(family_dir: Path) -> None:
    reference = hf_logits(family_dir, IDS)
    theirs = (hf_logits(family_dir, IDS, torch.bfloat16) - reference).abs().max().item()
    model = load_model(family_dir, "bf16")
    with torch.inference_mode():
        ours = (pieces(model, IDS, native=cpu_ops.usable(torch.empty(0), 16)) - reference).abs().max().item()
    assert ours <= 2 * theirs + 0.02, (ours, theirs)


def test_32_greedy_tokens_equal_transformers_generate(family_dir: Path) -> None:
    """Three prompts sharing a 16-token prefix, served together (the prefix cache hit by the later ones,
    chunks beside decodes), against `generate` on each alone; every end id of the family stops both."""
    from transformers import AutoModelForCausalLM

    engine = Engine.from_dir(
        family_dir,
        dtype="fp32",
        config=EngineConfig(block_size=BLOCK, kv_cache_bytes=1 << 22, max_num_batched_tokens=24),
    )
    eos = sorted(engine.tokenizer.eos_token_ids)
    if family_dir.name.startswith("llama3"):
        assert eos == [0, 318, 319]  # generation_config.json's list, all of them
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(1, 320, (16,), generator=gen).tolist()
    prompts = [shared + torch.randint(1, 320, (n,), generator=gen).tolist() for n in (3, 9, 20)]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, params))
    done: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    hf = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert done[str(i)] == expected
    assert engine.stats().prefix_hit_tokens >= 16  # a later prompt found the shared blocks cached


def test_llama3_and_yarn_rope_change_the_frequencies() -> None:
    """The scalings are not silently plain RoPE: Llama 3 slows the long wavelengths, YaRN scales cos/sin."""
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 256}  # fmt: skip
    plain = ModelConfig.from_dict(base).rope_scaling.frequencies(32)
    llama3 = ModelConfig.from_dict(
        base
        | {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        }
    ).rope_scaling.frequencies(32)
    assert torch.equal(plain[0][:1], llama3[0][:1]) and (llama3[0][-4:] < plain[0][-4:]).all()
    yarn = ModelConfig.from_dict(
        base | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    ).rope_scaling.frequencies(32)
    assert yarn[1] == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


def test_unsupported_rope_and_layer_types_name_what_is_supported() -> None:
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2}  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"'dynamic'.*default.*linear.*llama3.*yarn"):
        ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        ModelConfig.from_dict(
            base | {"use_sliding_window": True, "sliding_window": 4, "layer_types": ["chunked_attention"] * 2}
        )
    with pytest.raises(UnsupportedModelError, match=r"Gemma3ForCausalLM.*|this engine runs"):
        ModelConfig.from_dict(base | {"architectures": ["Phi3ForCausalLM"]})
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        ModelConfig.from_dict(base | {"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0})


@pytest.mark.parametrize(("fmt", "bound"), [("int8", 0.05), ("int4", 0.25)])
def test_quantize_on_load_stays_close_to_the_float_model(family_dir: Path, fmt: str, bound: float) -> None:
    """int8 and int4 weights quantized while loading (calibrated on the model's own tokenizer's text), over an
    int8 KV cache too: logits within the bounds `test_quantization` holds random-weight models to."""
    native = cpu_ops.usable(torch.empty(0), 16)
    model = load_model(family_dir, "bf16", fmt)
    assert model.weights_format == fmt
    with torch.inference_mode():  # against the bf16 model: the quantization's own error
        reference = pieces(load_model(family_dir, "bf16"), IDS, native)
        got = pieces(model, IDS, native)
    # Gemma's post-norms scale each sublayer's output to unit RMS, so weight noise is not diluted by the
    # residual stream: int8-sized noise on every matrix moves transformers' own tiny Gemma 3 logits 2.1-2.5x as
    # far as its Qwen3 or Llama 3 (2.9% vs 1.4%, 1.1%).
    if family_dir.name.startswith("gemma3"):
        bound *= 2
    assert ((got - reference).norm() / reference.norm()).item() < bound
    engine = Engine.from_dir(
        family_dir, weights=fmt, config=EngineConfig(kv_cache_dtype="int8", kv_cache_bytes=1 << 22)
    )
    engine.add_request(EngineRequest("q", IDS.tolist(), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    served = [t for out in iter_steps(engine) for t in out.new_token_ids]
    assert len(served) == 8


def iter_steps(engine: Engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_speculative_decoding_with_a_draft_keeps_the_greedy_tokens(family_dir: Path) -> None:
    """The model drafting for itself (same tokenizer): every draft is accepted and the tokens are plain greedy's."""
    from engines.speculative.speculator import SpeculativeConfig

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = Engine.from_dir(family_dir, dtype="fp32", config=EngineConfig(kv_cache_bytes=1 << 22))
    spec = Engine.from_dir(
        family_dir,
        dtype="fp32",
        draft_dir=family_dir,
        config=EngineConfig(
            kv_cache_bytes=1 << 22,
            speculative=SpeculativeConfig(method="draft", adaptive=False, draft_kv_cache_bytes=1 << 22),
        ),
    )
    tokens = []
    for engine in (plain, spec):
        engine.add_request(EngineRequest("s", IDS.tolist(), params))
        tokens.append([t for out in iter_steps(engine) for t in out.new_token_ids])
    assert tokens[0] == tokens[1] and len(tokens[0]) == 16
    stats = spec.stats().speculative
    assert stats["spec_accepted"] > 0 and stats["spec_acceptance_rate"] == 1.0


def test_a_windowed_model_holds_bounded_kv_however_long_it_generates(tmp_path: Path) -> None:
    """Mistral with a 12-token window in 4-token blocks: a 480-token generation holds at most 6 blocks at any
    step (the window's 3-4, the newest partial one, and one the next step allocates), where the same model
    without the release holds all 125; and its tokens are the same."""
    path = tiny_hf_model("mistral", tmp_path, max_position_embeddings=512)
    params = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)
    runs = []
    for release in (True, False):
        engine = Engine.from_dir(path, dtype="fp32", config=EngineConfig(block_size=BLOCK, kv_cache_bytes=1 << 22))
        assert engine.window == 12
        if not release:
            engine.window = 0
        engine.add_request(EngineRequest("long", IDS[:20].tolist(), params))
        peak, tokens = 0, []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
            peak = max(peak, engine.stats().blocks.kv_blocks_used)
        runs.append((peak, tokens))
        assert engine.stats().blocks.kv_blocks_used == 0  # and `free` gave back exactly the rest
    (bounded, ours), (unbounded, theirs) = runs
    assert ours == theirs and len(ours) == 480
    assert bounded <= 6 and unbounded == 125, (bounded, unbounded)
    print(f"peak KV blocks: {bounded} with the release, {unbounded} without")


def test_sharded_fp16_checkpoints_load(tmp_path: Path) -> None:
    """A directory of several safetensors shards with their index, stored in fp16: every tensor found."""
    from transformers import AutoModelForCausalLM

    path = tiny_hf_model("qwen3", tmp_path / "fp32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    sharded = tmp_path / "sharded"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((path / name).read_bytes())
    assert len(list(sharded.glob("*.safetensors"))) > 3 and (sharded / "model.safetensors.index.json").is_file()
    with torch.inference_mode():
        got = pieces(load_model(sharded, "fp32"), IDS, native=False)
        want = pieces(load_model(path, "fp32"), IDS, native=False)
    assert 0 < (got - want).abs().max().item() < 1e-2  # the fp16 rounding of the weights, nothing more
