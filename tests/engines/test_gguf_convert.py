"""The GGUF → Hugging Face conversion against transformers' own GGUF loader, tensor by tensor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engines.checkpoints.gguf_convert import hf_name, unpermute_rope
from engines.checkpoints.registry import REGISTRY
from engines.models.config import UnsupportedModelError

MODELS_HOME_GGUF = "gguf"


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation, written from its definition."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)
    for heads in (1, 2, 4):
        assert np.array_equal(unpermute_rope(permute_like_llama_cpp(w, heads), heads), w)


def test_tensor_names() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(UnsupportedModelError, match="unexpected GGUF tensor"):
        hf_name("blk.0.ffn_gate_exps.weight")


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_converted_weights_equal_transformers_gguf_loader(name: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM

    fixture = {"smollm2-135m-instruct": "smollm2_dir", "qwen2.5-coder-0.5b-instruct": "qwen05_dir"}[name]
    model_dir: Path = request.getfixturevalue(fixture)
    gguf = model_dir.parents[1] / MODELS_HOME_GGUF / REGISTRY[name].gguf_file
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    expected = {k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()}
    ours = load_file(model_dir / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    if config["tie_word_embeddings"]:
        expected.pop("lm_head.weight")
    assert set(ours) == set(expected)
    for key, tensor in ours.items():
        assert torch.equal(tensor, expected[key]), key


def test_converted_directory_is_complete(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert "<|im_start|>" in tok.chat_template
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in generation["eos_token_id"]
