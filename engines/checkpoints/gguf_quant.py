"""GGUF quantized blocks → our int4/int8 weights, keeping the file's own 4-bit codes where possible.

Q4_0 (w = (q-8)·d), Q4_1 (w = q·d + m) and Q4_K (w = d·sc·q − dmin·m per 32-value sub-block) all fit
`QuantizedWeight`'s int4 form w = (q-8)·scale + zero with group 32, so their codes are copied and only
scale and zero are computed. Other types (Q5_x, Q6_K, Q8_0, F16, ...) are dequantized with the `gguf`
package and quantized again. `target_format` decides what a tensor becomes: llama.cpp's mixes give
sensitive tensors 6 or 8 bits (Q4_K_M: ffn_down and attn_v in Q6_K/Q8_0), and those stay int8.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from engines.kernels.quantize import INT4_GROUP, QuantizedWeight, can_int4, pack_int4, quantize

FOUR_BIT = {QT.Q4_0, QT.Q4_1, QT.Q4_K}
# 5-bit blocks are closer to 4 than to 8 bits: under an int4 target they become int4.
AT_MOST_FIVE_BITS = FOUR_BIT | {QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q3_K, QT.Q2_K}


def target_format(types: list[tuple[QT, int]], requested: str) -> str:
    """The format of one (possibly fused) linear: `types` lists (GGUF type, elements) of its parts."""
    if requested == "int8":
        return "int8"
    low = sum(n for t, n in types if t in AT_MOST_FIVE_BITS)
    return "int4" if low * 2 >= sum(n for _, n in types) else "int8"


def to_quantized(raw: np.ndarray, qtype: QT, shape: tuple[int, int], fmt: str) -> QuantizedWeight:
    """One GGUF tensor (raw block bytes, our (N, K) shape) as a weight in format `fmt`."""
    n, k = shape
    if fmt == "int4" and qtype in FOUR_BIT and can_int4(n, k):
        codes, scales, zeros = _decode_4bit(np.ascontiguousarray(raw).reshape(n, -1), qtype, n, k)
        return QuantizedWeight(
            "int4", pack_int4(torch.from_numpy(codes)), torch.from_numpy(scales), torch.from_numpy(zeros), INT4_GROUP
        )
    w = torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32).reshape(n, k))
    return quantize(w, fmt if can_int4(n, k) or fmt == "int8" else "int8")  # type: ignore[arg-type]


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[..., offset : offset + 2].copy().view(np.float16).astype(np.float32)


def _decode_4bit(raw: np.ndarray, qtype: QT, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes (N, K) uint8 in 0..15, scales (N, K/32), zeros (N, K/32)) in the (q-8)·scale + zero form."""
    if qtype in (QT.Q4_0, QT.Q4_1):
        size = 18 if qtype == QT.Q4_0 else 20
        blocks = raw.reshape(n, k // 32, size)
        d = _fp16(blocks, 0)[..., 0]
        qs = blocks[..., size - 16 :]
        codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # low nibbles hold values 0-15, high 16-31
        zeros = np.zeros_like(d) if qtype == QT.Q4_0 else _fp16(blocks, 2)[..., 0] + 8 * d
        return codes.reshape(n, k), d, zeros
    # Q4_K: 256-value super-blocks of 8 sub-blocks, each with a 6-bit scale and min.
    blocks = raw.reshape(n, k // 256, 144)
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)  # (N, S, 1)
    packed = blocks[..., 4:16].astype(np.uint8)
    sc = np.concatenate((packed[..., 0:4] & 63, (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)), -1)
    mn = np.concatenate((packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)), -1)
    qs = blocks[..., 16:].reshape(n, k // 256, 4, 32)  # 64-value chunks: low nibbles first, then high
    codes = np.stack((qs & 0x0F, qs >> 4), axis=3).reshape(n, k)
    scales = (d * sc.astype(np.float32)).reshape(n, -1)
    zeros = (8 * d * sc.astype(np.float32) - dmin * mn.astype(np.float32)).reshape(n, -1)
    return codes, scales, zeros
