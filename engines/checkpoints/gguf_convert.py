"""Convert a llama.cpp GGUF file (llama, qwen2, gemma3) into a Hugging Face directory we and HF can load.

Weights are dequantized with the `gguf` package and stored as bf16 safetensors (the dtype the
checkpoints were trained in; a 4-bit grid rounds into bf16 with < 0.4% relative error, far below the
quantization error itself). Config and tokenizer (tokenizer.json plus the chat template) come from
transformers' own GGUF readers. Gemma 3: llama.cpp stores its norms as 1 + w (what they scale by), so
the conversion subtracts 1 back, as transformers' reader does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from engines.models.config import UnsupportedModelError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Qwen3 and Gemma 3
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # Gemma 3's norms around attention and MLP (its `ffn_norm` is the MLP's input norm)
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_LAYER_NAMES = {"ffn_norm": "pre_feedforward_layernorm"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Special tokens that end a turn in every chat format we ship; generation stops on any present.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>", "<end_of_turn>")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    names = _LAYER_NAMES | _GEMMA_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    if not m or m.group(2) not in names:
        raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name}")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def stored_norm_offset(arch: str, hf_tensor_name: str) -> float:
    """What llama.cpp added to a norm weight it stored: Gemma's norms scale by (1 + w) and its GGUF holds
    1 + w, so the conversion takes 1 back off (as transformers' reader does); 0 for every other tensor."""
    return 1.0 if arch == "gemma3" and hf_tensor_name.endswith("norm.weight") else 0.0


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving for Llama (its converter permutes for GPT-J-style RoPE)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: GGUFReader, key: str, default: object = None) -> object:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def convert_gguf(gguf_path: Path, out_dir: Path, *, dtype: torch.dtype = torch.bfloat16, progress: bool = True) -> None:
    from transformers import AutoConfig, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; we run {sorted(ARCHITECTURES)}")
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))

    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {gguf_path.name}", unit="tensor", disable=not progress):
        name = hf_name(t.name, arch)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGML lists dims fastest-first
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if arch == "llama" and ".attn_q." in t.name:
            w = unpermute_rope(w, n_head)
        elif arch == "llama" and ".attn_k." in t.name:
            w = unpermute_rope(w, n_kv)
        elif offset := stored_norm_offset(arch, name):
            w = w - offset
        tensors[name] = torch.tensor(w, dtype=dtype)  # copies: F32 tensors are read-only views of the file
    tied = "lm_head.weight" not in tensors
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config.architectures = [ARCHITECTURES[arch]]
    config.tie_word_embeddings = tied
    config.dtype = dtype
    config.save_pretrained(out_dir)

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    chat_template = _field(reader, "tokenizer.chat_template")
    if chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)

    vocab = tokenizer.get_vocab()
    eos = [int(_field(reader, "tokenizer.ggml.eos_token_id"))]
    if (eot := _field(reader, "tokenizer.ggml.eot_token_id")) is not None:
        eos.append(int(eot))
    eos += [vocab[t] for t in _END_TOKENS if t in vocab]
    generation = {
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted(set(eos)),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


GGUF_MARKER = "gguf_source.json"


def gguf_model_dir(home: Path, gguf_path: Path) -> Path:
    """Where a GGUF file a tier names by path is converted to: one directory per file (its resolved path,
    size and modification time), under `home/models/`."""
    import hashlib

    gguf_path = Path(gguf_path).expanduser().resolve()
    stat = gguf_path.stat() if gguf_path.is_file() else None
    key = f"{gguf_path}:{stat.st_size if stat else 0}:{stat.st_mtime_ns if stat else 0}"
    return Path(home) / "models" / f"gguf-{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_gguf_dir(gguf_path: Path, home: Path, *, progress: bool = True) -> Path:
    """The converted directory of a GGUF file, converting it the first time (into a staging directory that
    is renamed when complete, so an interrupted conversion is redone)."""
    from engines.checkpoints.staging import staged_dir

    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise UnsupportedModelError(f"{gguf_path}: no such GGUF file")
    out = gguf_model_dir(home, gguf_path)
    if (out / GGUF_MARKER).is_file():
        return out
    with staged_dir(out) as staging:
        convert_gguf(gguf_path, staging, progress=progress)
        (staging / GGUF_MARKER).write_text(json.dumps({"gguf": str(gguf_path.resolve())}) + "\n")
    return out
