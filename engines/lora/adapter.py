"""A LoRA adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`, as `peft` saves one and
vLLM loads one), read into the pairs our fused linear layers add (`engines.layers.lora`).

PEFT trains q, k, v and gate, up as separate matrices; we serve them fused (`qkv_proj`, `gate_up_proj`). A fused
layer's weights stack its parts' A matrices, (Σ ranks, in), and keep each part's B with the output rows it adds to:
each part's rows see only its own rank's columns, exactly as the separate products would, and a part the adapter
leaves out costs nothing. The scale (`lora_alpha / r`, or `/ √r` with `use_rslora`) is folded into B.

Refused with `AdapterError`, naming what is wrong, before anything is loaded: no config or no safetensors file (a
pickled `adapter_model.bin` is never read), a config that is not LoRA or asks for what the serving path does not do
(DoRA, trained biases, `modules_to_save`, per-module alphas), a tensor for a module the model does not have as a
dense linear layer (embeddings, the head, MoE experts), shapes that do not fit the model, an A without its B.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.checkpoints.loader import fused_name
from engines.layers.linear import Linear
from engines.layers.lora import LoraPart, LoraWeights
from engines.models import ModelConfig, build_model
from engines.models.llama import LlamaForCausalLM

__all__ = ["CONFIG", "PROJECTIONS", "WEIGHTS", "AdapterError", "LoraAdapter", "check_adapter", "load_adapter"]

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight → layer 3, self_attn, q_proj, A
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")
# The projections an adapter may train, by block: every one is a dense linear layer we serve (fused or not).
_TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
PROJECTIONS = (*_TARGETS["self_attn"], *_TARGETS["mlp"])


class AdapterError(ValueError):
    """An adapter that cannot be served on this model; the message says why."""


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter read for one model: its pairs by our module name (`layers.3.self_attn.qkv_proj`)."""

    path: Path
    digest: str  # sha256 of its config and weights: a changed file is another adapter (caches key on it)
    rank: int  # the largest rank of its modules
    pairs: dict[str, LoraWeights]

    @property
    def nbytes(self) -> int:
        tensors = [t for p in self.pairs.values() for t in (p.a, *(part.b for part in p.parts))]
        return sum(t.numel() * t.element_size() for t in tensors)


def load_adapter(path: str | Path, model: LlamaForCausalLM) -> LoraAdapter:
    """The PEFT directory at `path`, checked against `model` and read in its dtype and onto its device."""
    path = Path(path)
    config = _config(path)
    tensors = _tensors(path / WEIGHTS)
    alpha, rslora = float(config.get("lora_alpha") or config.get("r") or 8), bool(config.get("use_rslora"))
    parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # our module → shard → (A, B)
    found: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m[3] not in _TARGETS[m[2]]:
            raise AdapterError(f"{WEIGHTS}: {key} is not a LoRA pair on an attention or MLP projection")
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"{WEIGHTS}: {key} is not finite floating-point numbers")
        found.setdefault((int(m[1]), m[2], m[3]), {})[m[4]] = tensor
    if not found:
        raise AdapterError(f"{WEIGHTS} holds no LoRA weights")
    for (layer, block, proj), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{WEIGHTS}: layers.{layer}.{block}.{proj} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != rank or rank == 0:
            raise AdapterError(f"{WEIGHTS}: layers.{layer}.{block}.{proj}: A {tuple(a.shape)} and B {tuple(b.shape)}")
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        ours, shard = fused_name(f"layers.{layer}.{block}.{proj}.weight")
        ours = ours.removesuffix(".weight")
        parts.setdefault(ours, {})[shard] = (a.float(), b.float() * scale)
    pairs = {name: _fused(name, shards, model) for name, shards in parts.items()}
    digest = hashlib.sha256((path / CONFIG).read_bytes() + (path / WEIGHTS).read_bytes()).hexdigest()
    rank = max(part.b.shape[1] for p in pairs.values() for part in p.parts)
    return LoraAdapter(path, digest, rank, pairs)


def check_adapter(path: str | Path, model_dir: str | Path) -> LoraAdapter:
    """`load_adapter` against the model at `model_dir` without reading its weights: the model is built from its
    config on the meta device, so every check runs (shapes included) and the adapter's tensors keep no storage.
    What registers an adapter where no engine of that model is loaded (the CLI)."""
    with torch.device("meta"):
        model = build_model(ModelConfig.from_dir(Path(model_dir)))
    return load_adapter(path, model)  # type: ignore[arg-type]


def _config(path: Path) -> dict:
    if not (path / CONFIG).is_file():
        raise AdapterError(f"{path}: no {CONFIG} (a PEFT adapter directory holds {CONFIG} and {WEIGHTS})")
    if not (path / WEIGHTS).is_file():
        raise AdapterError(f"{path}: no {WEIGHTS} (pickled adapter_model.bin files are not read)")
    try:
        config = json.loads((path / CONFIG).read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{CONFIG} is not JSON: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{CONFIG}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    refused = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(config.get("modules_to_save")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    if asked := [k for k, v in refused.items() if v]:
        raise AdapterError(f"{CONFIG}: {', '.join(asked)} is not supported (plain LoRA pairs only)")
    return config


def _tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{WEIGHTS} cannot be read: {exc}") from None


def _fused(name: str, shards: dict[int, tuple[torch.Tensor, torch.Tensor]], model: LlamaForCausalLM) -> LoraWeights:
    """One pair for our (possibly fused) module from its parts' pairs, checked against the layer's shape."""
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        linear = None
    if not isinstance(linear, Linear):
        raise AdapterError(f"the model has no dense linear layer {name} for this adapter (MoE experts are not served)")
    sizes = _part_sizes(name, linear, model)
    if max(shards) >= len(sizes):
        raise AdapterError(f"{name}: part {max(shards)} of {len(sizes)}")
    dtype, device = model.dtype, model.device
    a_rows, parts = [], []
    for shard in sorted(shards):
        part_a, part_b = shards[shard]
        row, rows = sum(sizes[:shard]), sizes[shard]
        if part_a.shape[1] != linear.in_features or part_b.shape[0] != rows:
            raise AdapterError(
                f"{name} part {shard}: A {tuple(part_a.shape)} and B {tuple(part_b.shape)} do not fit "
                f"{linear.in_features} → {rows}"
            )
        a_rows.append(part_a)
        parts.append(LoraPart(row, part_b.to(device, dtype).contiguous()))
    return LoraWeights(torch.cat(a_rows).to(device, dtype).contiguous(), tuple(parts))


def _part_sizes(name: str, linear: Linear, model: LlamaForCausalLM) -> list[int]:
    """The output rows of each part of a fused layer (q, k, v; gate, up), or the one part of another."""
    cfg = model.config
    if name.endswith(".qkv_proj"):
        kv = cfg.num_key_value_heads * cfg.head_dim
        return [cfg.num_attention_heads * cfg.head_dim, kv, kv]
    if name.endswith(".gate_up_proj"):
        return [linear.out_features // 2] * 2
    return [linear.out_features]
