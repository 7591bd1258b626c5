"""Quantized model state: a loaded float model's layers quantized (`quantized_state`), and the on-disk form
of a quantized checkpoint, safetensors of codes plus `quantization.json` (`save_state`, `load_state`).
`engines.checkpoints.quantized` makes such checkpoints; `engines.checkpoints.loader` loads them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engines.kernels.quantize import QuantizedWeight, can_int4, outlier_channels, quantize, quantize_int8

QUANT_CONFIG = "quantization.json"
MARKER = "switchboard-source.json"  # engines.checkpoints.fetch's: which registry file a directory came from

State = dict[str, "QuantizedWeight | torch.Tensor"]


def is_quantized_dir(model_dir: Path) -> bool:
    return (Path(model_dir) / QUANT_CONFIG).is_file()


def calibration_ids(tokenizer: object, limit: int = 1024) -> list[int]:
    """Token ids of the shipped calibration text (prose, chat, code, maths; not the evaluation text)."""
    text = (Path(__file__).parent / "data" / "calibration.txt").read_text()
    return tokenizer.encode(text)[:limit]  # type: ignore[attr-defined]


@torch.inference_mode()
def activation_absmax(model: torch.nn.Module, ids: list[int]) -> dict[str, torch.Tensor]:
    """Largest |input| per channel of every linear layer over one forward pass of `ids`."""
    from engines.kernels.metadata import AttentionMetadata
    from engines.kernels.reference import TorchPagedAttention
    from engines.kv.cache import PagedKVCache
    from engines.layers.linear import Linear, _mkldnn_bf16

    cfg = model.config
    ids = ids[: cfg.max_position_embeddings]  # the rotary table ends there (a short-context model)
    blocks = -(-len(ids) // 16)
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, blocks, 16, model.dtype)
    cache.buffer.zero_()
    meta = AttentionMetadata.build(16, [list(range(blocks))], [0], [len(ids)])
    found: dict[str, torch.Tensor] = {}

    def hook(name: str):  # noqa: ANN202
        def record(_: torch.nn.Module, inputs: tuple[torch.Tensor, ...], __: torch.Tensor) -> None:
            found[name] = inputs[0].float().abs().amax(dim=0)

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, Linear)]
    dtype = model.dtype
    # Without AVX-512, torch's bf16 matmuls crawl (~4 GFLOP/s: 140 s for Qwen 1.5B); fp32 copies of
    # the weights run the pass ~20x faster, and bf16 -> fp32 -> bf16 gives back the same weights. (A
    # model that is quantized already runs our kernels, and keeps its dtype.)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    upcast = dtype == torch.bfloat16 and not _mkldnn_bf16() and all(m.kernel is None for m in linears)
    try:
        if upcast:
            model.to(torch.float32)
            cache = PagedKVCache(
                cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, blocks, 16, torch.float32
            )
            cache.buffer.zero_()
        if model.rope.cos.numel() == 0 or upcast:
            model.build_rope(model.dtype)
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), TorchPagedAttention(cache), meta)
        model.lm_head(hidden)
    finally:
        for h in handles:
            h.remove()
        if upcast:
            model.to(dtype)
            model.build_rope(dtype)
    return found


def quantized_state(model: torch.nn.Module, fmt: str, calibration: list[int] | None = None) -> State:
    """Quantize a loaded float model (before `prepare`): every linear to `fmt` where the int4 kernel
    takes its shape (else int8), embeddings and head to int8 rows. With `calibration` token ids, int8
    layers get their outlier input channels so they can run int8×int8 (`engines.layers.linear.Int8Kernel`)."""
    from engines.layers.linear import Embedding, Linear

    absmax = activation_absmax(model, calibration) if calibration else {}
    state: State = {}
    tied = model.config.tie_word_embeddings
    quantized = set()
    for name, module in model.named_modules():
        router = name.endswith((".mlp.gate", ".shared_expert_gate"))  # tiny, and decides every route
        if isinstance(module, Linear) and not (name == "lm_head" and tied) and not router:
            state[name] = _quantize_linear(module.weight.detach(), fmt, name, absmax.get(name))
            quantized.add(f"{name}.weight")
        elif isinstance(module, Embedding):
            head = absmax.get("lm_head") if tied else None  # the tied table is the head's weight
            state[name] = _quantize_linear(module.weight.detach(), "int8", "lm_head", head)
            quantized.add(f"{name}.weight")
    for name, param in model.named_parameters():
        if name not in quantized:  # norms and biases stay as they are
            state[name] = param.detach().clone()
    return state


def _quantize_linear(w: torch.Tensor, fmt: str, name: str, absmax: torch.Tensor | None) -> QuantizedWeight:
    if fmt == "int4" and name != "lm_head" and can_int4(*w.shape):
        return quantize(w, "int4")
    return quantize_int8(w, None if absmax is None else outlier_channels(absmax))


def save_state(state: State, out_dir: Path, *, fmt: str, source: str, copy_from: Path) -> None:
    """Write `state` as `model.safetensors` + `quantization.json`; config and tokenizer from `copy_from`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict] = {}
    for name, value in state.items():
        if isinstance(value, QuantizedWeight):
            tensors[f"{name}.q"] = value.q.contiguous()
            tensors[f"{name}.scales"] = value.scales.float().contiguous()
            for part in ("zeros", "outliers"):
                if (extra := getattr(value, part)) is not None:
                    tensors[f"{name}.{part}"] = extra.contiguous()
            modules[name] = {"format": value.format, "group_size": value.group_size}
        else:
            tensors[name] = value.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "switchboard-quantized"})
    for file in Path(copy_from).iterdir():  # config, generation config, tokenizer, chat template
        if file.is_file() and file.suffix != ".safetensors" and file.name not in (MARKER, QUANT_CONFIG):
            shutil.copy2(file, out_dir / file.name)
    config = {"weights": fmt, "source": source, "modules": modules}
    (out_dir / QUANT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """A copy when misaligned: safetensors places tensors at any byte offset, and torch's packed int8
    kernel crashes (SIGSEGV) on weights that do not start on a 64-byte boundary."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


def load_state(model_dir: Path) -> tuple[dict, State]:
    config = json.loads((Path(model_dir) / QUANT_CONFIG).read_text())
    state: State = {}
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for name, spec in config["modules"].items():
            zeros, outliers = (f.get_tensor(k) if k in keys else None for k in (f"{name}.zeros", f"{name}.outliers"))
            state[name] = QuantizedWeight(
                spec["format"],
                _aligned(f.get_tensor(f"{name}.q")),
                f.get_tensor(f"{name}.scales"),
                zeros,
                spec["group_size"],
                outliers,
            )
            keys -= {f"{name}.q", f"{name}.scales", f"{name}.zeros", f"{name}.outliers"}
        for key in keys:
            state[key] = f.get_tensor(key)
    return config, state
