"""Load a Hugging Face directory (config.json + *.safetensors) into our decoder implementations."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engines.checkpoints.quant_state import calibration_ids, is_quantized_dir, load_state, quantized_state
from engines.kernels.quantize import WEIGHT_FORMATS, QuantizedWeight
from engines.models import build_model
from engines.models.config import ModelConfig, UnsupportedModelError
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


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "bf16",
    weights: str | None = None,
    *,
    prepare: bool = True,
    device: str | torch.device = "cpu",
) -> LlamaForCausalLM:
    """Load a HF directory or one of our quantized checkpoints, onto `device`. Weights are read (and
    quantized) on the CPU, then moved; quantized ones go to the device before their layer picks a kernel,
    so the device's backend (`engines.kernels.backends`) serves them.

    `weights`: None serves the directory as stored; "int8"/"int4" quantize a float checkpoint while
    loading (a quantized directory must match); "bf16" refuses a quantized directory.
    """
    from engines.tokenizer import Tokenizer

    model_dir = Path(model_dir)
    if weights not in (None, *WEIGHT_FORMATS):
        raise ValueError(f"weights {weights!r} is not supported; use one of {list(WEIGHT_FORMATS)}")
    if is_quantized_dir(model_dir):
        return _load_quantized(model_dir, resolve_dtype(dtype), weights, torch.device(device))
    model = _load_float(model_dir, resolve_dtype(dtype))
    state = (
        quantized_state(model, weights, calibration_ids(Tokenizer(model_dir))) if weights in ("int8", "int4") else {}
    )
    model = model.to(device)
    if state:
        apply_state(model, state)
    if prepare:
        model.prepare()
    return model


def _build(cfg: ModelConfig, dtype: torch.dtype, skip: set[str] = frozenset()) -> LlamaForCausalLM:
    """The model with uninitialised storage; modules in `skip` get no float weight at all."""
    with torch.device("meta"):
        model = build_model(cfg)
    for name in skip:
        model.get_submodule(name).weight = None
    model = model.to_empty(device="cpu").to(dtype)  # allocate without a wasted random init
    if cfg.tie_word_embeddings and model.embed_tokens.weight is not None:  # to_empty breaks the tie
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def _load_float(model_dir: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{model_dir} has no *.safetensors weights")
    model = _build(cfg, dtype)
    params = dict(model.named_parameters())  # a tied lm_head is not listed separately
    loaded: set[tuple[str, int]] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                loaded.update(_load_tensor(params, name, f.get_tensor(name), cfg))
    expected = {(n, shard) for n in params for shard in range(_num_shards(n))}
    if missing := expected - loaded:
        names = sorted({n for n, _ in missing})
        raise UnsupportedModelError(f"{model_dir}: weights missing for {names[:5]}")
    return model


def _load_quantized(model_dir: Path, dtype: torch.dtype, weights: str | None, device: torch.device) -> LlamaForCausalLM:
    config, state = load_state(model_dir)
    if weights is not None and weights != config["weights"]:
        raise UnsupportedModelError(f"{model_dir} holds {config['weights']} weights, not {weights}")
    cfg = ModelConfig.from_dir(model_dir)
    skip = set(config["modules"]) | ({"lm_head"} if cfg.tie_word_embeddings else set())
    model = _build(cfg, dtype, skip).to(device)
    apply_state(model, state)
    model.prepare()
    return model


def apply_state(model: LlamaForCausalLM, state: dict) -> None:
    """Put a quantized state (`engines.checkpoints.quant_state`) into the model; float weights it replaces
    are dropped. Every parameter left must be covered, or the checkpoint does not fit the model."""
    dtype, device = model.dtype, model.device
    params = dict(model.named_parameters())
    covered: set[str] = set()
    for name, value in state.items():
        if isinstance(value, QuantizedWeight):
            value = value.to(device)
            module = model.get_submodule(name)
            module.set_quantized(value, dtype)
            covered.add(f"{name}.weight")
            if name == "embed_tokens" and model.config.tie_word_embeddings:
                model.lm_head.set_quantized(value, dtype)
        elif name in params:
            _copy(params[name].data, value, name)
            covered.add(name)
        else:
            raise UnsupportedModelError(f"unexpected tensor {name} in a quantized checkpoint")
    left = {n for n, p in model.named_parameters() if p is not None} - covered
    if left:
        raise UnsupportedModelError(f"quantized checkpoint misses {sorted(left)[:5]}")


def fused_name(name: str) -> tuple[str, int]:
    """A HF parameter name (without `model.`) → (our fused name, shard index)."""
    for hf_part, (ours, shard) in _FUSED.items():
        if f".{hf_part}." in name:
            return name.replace(hf_part, ours), shard
    return name, 0


def _num_shards(name: str) -> int:
    return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1


# Mixtral's names for the parts of an expert and for its MoE block.
_MIXTRAL = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def _load_tensor(
    params: dict[str, torch.nn.Parameter], hf_name: str, tensor: torch.Tensor, cfg: ModelConfig
) -> list[tuple[str, int]]:
    """Copy one checkpoint tensor into its place; returns the (our name, shard) pairs it filled."""
    name = hf_name.removeprefix("model.")
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return []  # same matrix as the embedding
    if "rotary_emb" in name:
        return []
    if cfg.architecture == "MixtralForCausalLM":
        for theirs, ours in _MIXTRAL.items():
            name = name.replace(theirs, ours)
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # all experts in one 3-D tensor
        prefix, part = name.rsplit(".", 1)
        filled = []
        for e in range(tensor.shape[0]):
            filled += _load_tensor(params, f"{prefix}.{e}.{part}.weight", tensor[e], cfg)
        return filled
    for hf_part, (ours, shard) in _FUSED.items():
        if f".{hf_part}." in name:
            name = name.replace(hf_part, ours)
            param = params.get(name)
            if param is None:
                raise UnsupportedModelError(f"unexpected tensor {hf_name}")
            sizes = _shard_sizes(ours, cfg, param)
            start = sum(sizes[:shard])
            dest = param.data.narrow(0, start, sizes[shard])
            _copy(dest, tensor, hf_name)
            return [(name, shard)]
    param = params.get(name)
    if param is None:
        raise UnsupportedModelError(f"unexpected tensor {hf_name}")
    _copy(param.data, tensor, hf_name)
    return [(name, 0)]


def _shard_sizes(fused: str, cfg: ModelConfig, param: torch.Tensor) -> list[int]:
    if fused == "qkv_proj":
        kv = cfg.num_key_value_heads * cfg.head_dim
        return [cfg.num_attention_heads * cfg.head_dim, kv, kv]
    return [param.shape[0] // 2] * 2  # gate and up: dense, expert and shared-expert sizes differ


def _copy(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dest.shape != src.shape:
        raise UnsupportedModelError(f"{name}: shape {tuple(src.shape)} does not match {tuple(dest.shape)}")
    dest.copy_(src)
