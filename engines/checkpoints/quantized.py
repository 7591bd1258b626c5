"""Quantized checkpoints: safetensors of int8/int4 codes plus `quantization.json`, from a bf16 model or
straight from a GGUF file's blocks, and loaded without ever holding the float weights.

State names follow our modules (`layers.0.self_attn.qkv_proj`, fused): a quantized module stores
`NAME.q`, `NAME.scales` and, for int4, `NAME.zeros`; everything else (norms, biases) is a plain tensor
under its parameter name. Embeddings and the output head are int8 rows: the head is read every step
(a third of Qwen 1.5B's bytes) and int8 keeps its logits within ~0.1% perplexity, while quantizing it
to int4 ourselves would not be worth the risk. The exception is a GGUF whose table is already 4-bit
(Qwen's Q4_K_M token_embd): under int4 its own codes are kept, which is exactly the file's table and
a third fewer bytes per step than int8. A tied embedding shares the head's codes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from engines.checkpoints.loader import _build, apply_state, fused_name, load_model
from engines.checkpoints.quant_state import (
    MARKER,
    State,
    activation_absmax,
    calibration_ids,
    is_quantized_dir,
    quantized_state,
    save_state,
)
from engines.checkpoints.staging import staged_dir
from engines.kernels.quantize import QuantizedWeight, can_int4, concat_rows, outlier_channels, quantize_int8
from engines.models.config import ModelConfig, UnsupportedModelError
from engines.tokenizer import Tokenizer

__all__ = ["calibrate_int8", "fetch_quantized", "is_quantized_dir", "quantize_checkpoint", "state_from_gguf"]


def state_from_gguf(gguf_path: Path, cfg: ModelConfig, fmt: str, *, progress: bool = True) -> State:
    """Our state straight from GGUF blocks: 4-bit blocks keep their codes (`engines.checkpoints.gguf_quant`)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from engines.checkpoints.gguf_convert import hf_name, stored_norm_offset, unpermute_rope
    from engines.checkpoints.gguf_quant import FOUR_BIT, target_format, to_quantized

    reader = GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    shards: dict[str, dict[int, tuple]] = {}
    biases: dict[str, dict[int, torch.Tensor]] = {}
    state: State = {}
    for t in reader.tensors:
        ours, shard = fused_name(hf_name(t.name, arch).removeprefix("model."))
        shape = tuple(int(d) for d in reversed(t.shape))
        role = t.name.split(".")[-2]
        perm = None
        if arch == "llama" and role in heads:  # llama.cpp interleaves q/k rows for its RoPE
            perm = torch.from_numpy(unpermute_rope(np.arange(shape[0]), heads[role]).copy())
        if len(shape) == 2 and ours.endswith(".weight") and "embed" not in ours and ours != "lm_head.weight":
            shards.setdefault(ours.removesuffix(".weight"), {})[shard] = (t, shape, perm)
        elif ours in ("embed_tokens.weight", "lm_head.weight"):
            if fmt == "int4" and t.tensor_type in FOUR_BIT and can_int4(*shape):
                # Already 4-bit in the file: its codes, exactly (int8 would only re-grid the same values).
                state[ours.removesuffix(".weight")] = to_quantized(t.data, t.tensor_type, shape, "int4")
                continue
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
            state[ours.removesuffix(".weight")] = quantize_int8(w)
        else:
            value = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
            if perm is not None:
                value = value[perm]
            if offset := stored_norm_offset(arch, ours):
                value = value - offset
            if ours.endswith(".bias"):
                biases.setdefault(ours, {})[shard] = value
            else:
                state[ours] = value.to(torch.bfloat16)
    for name, parts in biases.items():
        state[name] = torch.cat([parts[i] for i in sorted(parts)]).to(torch.bfloat16)
    for name, parts in tqdm(shards.items(), desc=f"quantizing {gguf_path.name}", unit="linear", disable=not progress):
        ordered = [parts[i] for i in sorted(parts)]
        kinds = [(t.tensor_type, shape[0] * shape[1]) for t, shape, _ in ordered]
        layer_fmt = target_format(kinds, fmt)
        if layer_fmt == "int4" and not all(can_int4(*shape) for _, shape, _ in ordered):
            layer_fmt = "int8"
        qws = []
        for t, shape, perm in ordered:
            qw = to_quantized(t.data, t.tensor_type, shape, layer_fmt)
            qws.append(qw if perm is None else qw.rows(perm))
        state[name] = concat_rows(qws)
    if cfg.tie_word_embeddings:
        state.pop("lm_head", None)
    return state


def calibrate_int8(state: State, model_dir: Path) -> None:
    """Find the outlier channels of a state's int8 layers by running the quantized model itself (for a
    GGUF source there is no float model; the activations differ from it only by quantization noise)."""
    cfg = ModelConfig.from_dir(model_dir)
    names = {n for n, v in state.items() if isinstance(v, QuantizedWeight)}
    model = _build(cfg, torch.bfloat16, names | ({"lm_head"} if cfg.tie_word_embeddings else set()))
    apply_state(model, state)
    absmax = activation_absmax(model, calibration_ids(Tokenizer(model_dir)))
    for name, value in state.items():
        layer = "lm_head" if name == "embed_tokens" and cfg.tie_word_embeddings else name
        if isinstance(value, QuantizedWeight) and value.format == "int8" and layer in absmax:
            value.outliers = outlier_channels(absmax[layer])


def quantize_checkpoint(src: Path, out_dir: Path, fmt: str, *, gguf: Path | None = None, progress: bool = True) -> Path:
    """`switchboard models quantize`: `src` is a converted HF directory; with `gguf`, its original file,
    whose 4-bit blocks are kept. Written to a staging directory and renamed into place."""
    if fmt not in ("int8", "int4"):
        raise ValueError(f"weights must be int8 or int4, not {fmt!r}")
    if is_quantized_dir(src):
        raise UnsupportedModelError(f"{src} is already quantized")
    out_dir = Path(out_dir)
    with staged_dir(out_dir) as staging:
        if gguf is not None:
            state = state_from_gguf(gguf, ModelConfig.from_dir(src), fmt, progress=progress)
            calibrate_int8(state, src)
            source = f"gguf:{Path(gguf).name}"
        else:
            model = load_model(src, "bf16", prepare=False)
            state = quantized_state(model, fmt, calibration_ids(Tokenizer(src)))
            source = f"hf:{Path(src).name}"
        save_state(state, staging, fmt=fmt, source=source, copy_from=src)
    return out_dir


def fetch_quantized(name: str, home: Path, fmt: str, *, progress: bool = True) -> Path:
    """A registry model's quantized checkpoint, made once: int4 keeps the GGUF file's own 4-bit
    blocks, int8 is quantized (and calibrated) from the converted bf16 weights. Idempotent."""
    from engines.checkpoints.fetch import assemble_gguf, fetch_model, quantized_dir, registry_model

    entry = registry_model(name)
    out = quantized_dir(home, name, fmt)
    marker = out / MARKER
    try:
        if json.loads(marker.read_text()).get("sha256") == entry.sha256 and is_quantized_dir(out):
            return out
    except (OSError, ValueError):
        pass
    hf_dir = fetch_model(name, home, progress=progress)
    gguf = assemble_gguf(entry, Path(home) / "gguf", progress=progress) if fmt == "int4" else None
    if progress:
        print(f"{name}: quantizing to {fmt} at {out}", flush=True)
    quantize_checkpoint(hf_dir, out, fmt, gguf=gguf, progress=progress)
    marker.write_text(json.dumps({"name": name, "sha256": entry.sha256, "weights": fmt}, indent=2))
    return out
