"""Our decoder against HF transformers' own implementation on the same weights (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.checkpoints.loader import load_model
from engines.kernels.metadata import AttentionMetadata
from engines.kernels.reference import TorchPagedAttention
from engines.kv.cache import PagedKVCache
from engines.models.config import ModelConfig, UnsupportedModelError
from engines.models.llama import LlamaForCausalLM
from tiny import tiny_hf_model


def run_in_pieces(model: LlamaForCausalLM, ids: torch.Tensor, cuts: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits for every position, computed as a prefill, then extends, then single-token decodes,
    through the paged KV cache with the sequence's blocks scattered over the pool."""
    cfg = model.config
    needed = -(-len(ids) // block_size)
    cache = PagedKVCache(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.head_dim,
        needed + 3,
        block_size,
        model.dtype,
    )
    table = torch.randperm(needed + 3, generator=torch.Generator().manual_seed(0))[:needed].tolist()
    cache.zero_blocks(list(range(needed + 3)))  # as the engine does before a block's first use
    backend, out, start = TorchPagedAttention(cache), [], 0
    for end in [*cuts, *range(cuts[-1] + 1, len(ids) + 1)]:
        meta = AttentionMetadata.build(block_size, [table], [start], [end - start])
        hidden = model(ids[start:end], torch.arange(start, end), backend, meta)
        out.append(model.compute_logits(hidden))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"tie_word_embeddings": False, "num_key_value_heads": 4}),
        ("qwen2", {"tie_word_embeddings": False}),
        ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
        ("qwen2_moe", {"norm_topk_prob": False}),
        ("qwen2_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2}),  # layer 0 dense, layer 1 sparse
        ("mixtral", {}),
    ],
)
def test_tiny_models_match_transformers(arch: str, overrides: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_hf_model(arch, tmp_path, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, "fp32")
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    got = run_in_pieces(ours, ids, cuts=[17, 29])
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


def test_bf16_load_and_tied_weights(tmp_path: Path) -> None:
    ours = load_model(tiny_hf_model("llama", tmp_path, tie_word_embeddings=True), "bf16")
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    assert ours.lm_head.weight is ours.embed_tokens.weight


def test_missing_and_unsupported_weights_fail_clearly(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = tiny_hf_model("llama", tmp_path)
    weights = load_file(path / "model.safetensors")
    weights.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.self_attn\.qkv_proj"):
        load_model(path, "fp32")


def test_unsupported_configs_are_refused() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    assert ModelConfig.from_dict(base).head_dim == 4
    with pytest.raises(UnsupportedModelError, match="not supported"):
        ModelConfig.from_dict({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedModelError, match="rope scaling"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 3, "sliding_window": 8}
    assert ModelConfig.from_dict(qwen).windows == ()  # Qwen configs carry a window they do not use
    windowed = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    assert windowed.windows == (0, 8, 8)


def _compare_with_transformers(model_dir: Path, prompt: str) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor(tok(prompt)["input_ids"])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    del hf
    ours = load_model(model_dir, "fp32")
    with torch.inference_mode():
        got = run_in_pieces(ours, ids, cuts=[len(ids) - 6, len(ids) - 3])
    return (got - expected).abs().max().item()


PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'


def test_smollm2_logits_match_transformers(smollm2_dir: Path) -> None:
    assert _compare_with_transformers(smollm2_dir, PROMPT) < 1e-3


def test_qwen_coder_05b_logits_match_transformers(qwen05_dir: Path) -> None:
    assert _compare_with_transformers(qwen05_dir, PROMPT) < 1e-3
