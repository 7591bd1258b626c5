"""Load a Hugging Face directory (config.json + *.safetensors) into our decoder implementations."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engines.model_config import ModelConfig, UnsupportedModelError
from engines.models import build_model
from engines.models.llama import LlamaForCausalLM

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}

# HF keeps q/k/v and gate/up as separate matrices; we fuse each group into one (name, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(DTYPES)}") from None


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "bf16") -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{model_dir} has no *.safetensors weights")
    torch_dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = build_model(cfg)
    model = model.to_empty(device="cpu").to(torch_dtype)  # allocate without a wasted random init
    if cfg.tie_word_embeddings:  # to_empty breaks the tie; restore it before loading
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters())  # a tied lm_head is not listed separately
    loaded: set[tuple[str, int]] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                target = _load_tensor(params, name, f.get_tensor(name), cfg)
                if target:
                    loaded.add(target)
    expected = {(n, shard) for n in params for shard in range(_num_shards(n))}
    if missing := expected - loaded:
        names = sorted({n for n, _ in missing})
        raise UnsupportedModelError(f"{model_dir}: weights missing for {names[:5]}")
    model = model.eval().requires_grad_(False)
    model.prepare()
    return model


def _num_shards(name: str) -> int:
    return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1


def _load_tensor(
    params: dict[str, torch.nn.Parameter], hf_name: str, tensor: torch.Tensor, cfg: ModelConfig
) -> tuple[str, int] | None:
    """Copy one checkpoint tensor into its place; returns (our name, shard) or None if skipped."""
    name = hf_name.removeprefix("model.")
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None  # same matrix as the embedding
    if "rotary_emb" in name:
        return None
    for hf_part, (ours, shard) in _FUSED.items():
        if f".{hf_part}." in name:
            name = name.replace(hf_part, ours)
            param = params.get(name)
            if param is None:
                raise UnsupportedModelError(f"unexpected tensor {hf_name}")
            sizes = _shard_sizes(ours, cfg)
            start = sum(sizes[:shard])
            dest = param.data.narrow(0, start, sizes[shard])
            _copy(dest, tensor, hf_name)
            return name, shard
    param = params.get(name)
    if param is None:
        raise UnsupportedModelError(f"unexpected tensor {hf_name}")
    _copy(param.data, tensor, hf_name)
    return name, 0


def _shard_sizes(fused: str, cfg: ModelConfig) -> list[int]:
    if fused == "qkv_proj":
        kv = cfg.num_key_value_heads * cfg.head_dim
        return [cfg.num_attention_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


def _copy(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dest.shape != src.shape:
        raise UnsupportedModelError(f"{name}: shape {tuple(src.shape)} does not match {tuple(dest.shape)}")
    dest.copy_(src)
