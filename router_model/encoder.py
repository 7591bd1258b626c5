"""MiniLM for routing decisions: the same all-MiniLM-L6-v2 sentence embedding, its matmuls in int8.

The gateway routes while the client waits, and on these CPUs MiniLM is compute-bound: at ~80 word pieces
its 37 fp32 matmuls took 18 ms of a 29 ms embedding on one Zen 5 core (96 GFLOP/s). int8×int8 products
(`torch._int_mm`, VNNI where the CPU has it) run the same shapes ~4x faster. Weights are quantized per
output channel and activations per token, symmetric, so one outlier token or channel does not flatten the
rest (cosine to the fp32 embedding ≥ 0.99 on the shipped prompts, where fbgemm's per-tensor activations
gave 0.94). Attention, GELU and LayerNorm stay fp32.

Where the CPU has no int8 dot-product instructions (AVX-512 VNNI or AMX; a Zen 3 has AVX2 only),
`torch._int_mm` falls back to a path ~70x slower than an fp32 matmul of the same shape (82 ms against 1.2 ms
for 64x384 by 384x1536, one Zen 3 core): there the same int8 codes are multiplied as floats instead, fp32
where every sum is exact (K x 127 x 127 < 2^24, so K <= 1040) and fp64 past that. The products are the
same integers either way, so a text gets the same vector on every CPU.

Each text is encoded alone, never padded into a batch: a text gets the same vector at training time and
in the gateway, and on a CPU padding only adds work. Integer products make it deterministic too.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from core.embedder import Embedder, minilm_path
from engines.kernels.cpu_info import cpu_flags
from engines.layers.linear import quantize_rows

MAX_WORD_PIECES = 256  # MiniLM's own limit (sentence-transformers' max_seq_length for this model)
EXACT_FP32_K = (1 << 24) // (127 * 127)  # 1040: longest int8 dot product an fp32 sum holds exactly


def int_mm_is_fast() -> bool:
    """Whether `torch._int_mm` has int8 dot-product instructions to run on (AVX-512 VNNI or AMX)."""
    return bool({"avx512_vnni", "amx_int8"} & cpu_flags())


class Int8Linear(nn.Module):
    """`nn.Linear` as int8 weights per output channel × int8 activations per token, fp32 out."""

    def __init__(self, linear: nn.Linear, int_mm: bool | None = None) -> None:
        super().__init__()
        codes, scales = quantize_rows(linear.weight.detach().float())
        self.int_mm = int_mm_is_fast() if int_mm is None else int_mm
        exact = torch.float32 if linear.in_features <= EXACT_FP32_K else torch.float64
        # (in, out): `_int_mm` reads the transposed view fine; without VNNI the codes as floats (see the top)
        self.register_buffer("codes_t", codes.T if self.int_mm else codes.T.to(exact).contiguous())
        self.register_buffer("scales", scales.T.contiguous())  # (1, out)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), False)
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        codes, scales = quantize_rows(rows)
        # without VNNI: the same integer sums as floats, exact in the codes' dtype (see the top)
        products = torch._int_mm(codes, self.codes_t) if self.int_mm else codes.to(self.codes_t.dtype) @ self.codes_t
        out = products.float().mul_(scales).mul_(self.scales)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


class _Layer(nn.Module):
    """One BERT encoder layer (post-LayerNorm) over one unpadded text: (T, hidden) → (T, hidden)."""

    def __init__(self, layer: nn.Module, heads: int, int_mm: bool | None = None) -> None:
        super().__init__()
        attention = layer.attention
        q, k, v = attention.self.query, attention.self.key, attention.self.value
        fused = nn.Linear(q.in_features, 3 * q.out_features)  # one product for Q, K and V
        with torch.no_grad():
            fused.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            fused.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
        self.qkv = Int8Linear(fused, int_mm)
        self.out = Int8Linear(attention.output.dense, int_mm)
        self.norm1 = attention.output.LayerNorm
        self.up = Int8Linear(layer.intermediate.dense, int_mm)
        self.down = Int8Linear(layer.output.dense, int_mm)
        self.norm2 = layer.output.LayerNorm
        self.heads = heads

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens, hidden = h.shape
        # (1, heads, tokens, head_dim): SDPA's fused CPU kernel wants 4-D; 3-D takes the slow math path
        q, k, v = self.qkv(h).view(1, tokens, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(tokens, hidden)
        h = self.norm1(self.out(attended) + h)
        return self.norm2(self.down(nn.functional.gelu(self.up(h))) + h)


class Int8MiniLM:
    """all-MiniLM-L6-v2 with int8 matmuls: mean-pooled over the word pieces, then L2-normalized
    (the model's sentence-transformers pooling and normalization). The layers are ours (Q, K and V fused,
    no padding or mask to build); the weights, embeddings and tokenizer are the shipped model's.
    `int_mm`: multiply with `torch._int_mm` or as floats (default: by the CPU, `int_mm_is_fast`)."""

    def __init__(self, int_mm: bool | None = None) -> None:
        from transformers import AutoModel, AutoTokenizer

        path = minilm_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModel.from_pretrained(str(path)).eval()  # its pooler goes unused
        if model.config.hidden_act != "gelu" or model.config.position_embedding_type != "absolute":
            raise ValueError(f"{path}: not the BERT layout Int8MiniLM implements")
        self.embeddings = model.embeddings
        heads = model.config.num_attention_heads
        self.layers = nn.ModuleList(_Layer(layer, heads, int_mm) for layer in model.encoder.layer)

    @torch.inference_mode()
    def encode(self, texts: list[str], normalize_embeddings: bool = True, convert_to_numpy: bool = True) -> np.ndarray:
        vectors = np.zeros((len(texts), Embedder.DIM), np.float32)
        for i, text in enumerate(texts):
            ids = self.tokenizer(text, truncation=True, max_length=MAX_WORD_PIECES, return_tensors="pt")
            h = self.embeddings(input_ids=ids["input_ids"], token_type_ids=ids["token_type_ids"])[0]
            for layer in self.layers:
                h = layer(h)
            vector = h.mean(dim=0)  # no padding: every position is a word piece
            if normalize_embeddings:
                vector = nn.functional.normalize(vector, dim=0)
            vectors[i] = vector.numpy()
        return vectors


class RouterEncoder(Embedder):
    """The router's embedder: `Embedder`'s cache and locking around `Int8MiniLM`."""

    def _build(self) -> object:
        return Int8MiniLM()
