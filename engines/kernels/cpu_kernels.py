"""Our own CPU kernels (`engines/kernels/csrc/`): int4 and int8 weight GEMMs on AVX2 integer dot products
(`quant_gemm.cpp`, wrapped here), fused decoder ops (`cpu_ops.cpp`) and LoRA deltas (`lora.cpp`), both wrapped in
`engines.kernels.cpu_ops`, built on first use with the system's C++ compiler and loaded with ctypes.

Three builds of the same sources, picked once at load from the CPU's flags, the widest first: `amx`
(the VNNI build plus the int8 GEMM on AMX tiles from 4 activation rows, `csrc/amx_int8.h`),
`avx512-vnni` (one vpdpbusd per sum of four byte products) and `avx2` (vpmaddubsw + vpmaddwd for the
same sums). Every int32 sum is exact in each, so every build computes the same bits.
`SWITCHBOARD_CPU_KERNELS=avx2` (or `avx512-vnni`) forces a narrower build on a wider machine (tests run
each); `variant()` names the one in use.

Why our own: torch's int4 kernel dequantizes to float and is compute-bound (14 G weights/s on two AVX2
cores, 35 on AVX-512), its weight-only int8 kernel streams ~18 GB/s, and fbgemm's int8 GEMM saturates
without VNNI; decode wants the memory's 32-40 GB/s. These kernels quantize each token's activations
on the fly (8 bits per 32 inputs against int4 weights, as llama.cpp's Q8_0; 7 bits per 256 against
int8 weights, see quant_gemm.cpp) and multiply codes directly, as llama.cpp does.

The library links the same OpenMP runtime torch loaded (same soname), so it shares torch's threads and
honours OMP_NUM_THREADS. Built once per source, flags and compiler into `$SWITCHBOARD_HOME/kernels`.
Where there is no compiler or no AVX2 (or `SWITCHBOARD_NATIVE_KERNELS=0`), `available()` is False and
`engines.layers.linear` falls back to torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engines.kernels.cpu_info import cpu_flags
from engines.kernels.quantize import QuantizedWeight, unpack_int4

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "csrc" / name for name in ("quant_gemm.cpp", "cpu_ops.cpp", "decoder.cpp", "lora.cpp")
]
# Included by quant_gemm.cpp: part of the build's digest.
HEADERS = [Path(__file__).parent / "csrc" / name for name in ("int4_slabs.h", "amx_int8.h", "amx_int4.h")]
# -ffp-contract=off: no fused multiply-adds but the ones written out, so elementwise ops round as torch's do.
FLAGS = [
    "-ffp-contract=off",
    "-O3",
    "-std=c++17",
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-fopenmp",
    "-shared",
    "-fPIC",
]
VARIANTS: dict[str, list[str]] = {
    "avx2": [],
    # 256-bit vpdpbusd needs VNNI and VL; BW for the byte ops the compiler may pick at 512 bits.
    "avx512-vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
    "amx": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile", "-mamx-int8"],
}
NARROWER = {"amx": "avx512-vnni", "avx512-vnni": "avx2"}  # where a build fails or the CPU lacks its flags
CPU_FLAGS_FOR = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512-vnni": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    "amx": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"},
}
NAMES = {1: "avx2", 2: "avx512-vnni", 3: "amx"}  # sb_variant()'s numbers
GROUP = 32
# int8 weights: activations share a scale per 256 inputs, so the integer dot product runs 8 groups
# between float steps (with 7-bit activations, as fast as fbgemm's int8 GEMM at 16 rows; see
# quant_gemm.cpp); int4 weights change scale every 32, and take 8-bit activations.
INT8_ACT_GROUP = 256


def _cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def supported(variant: str) -> bool:
    """Whether this CPU runs `variant`'s build."""
    return CPU_FLAGS_FOR[variant] <= cpu_flags()


def chosen_variant() -> str:
    """`SWITCHBOARD_CPU_KERNELS` (auto, avx2, avx512-vnni or amx); auto: the widest build this CPU runs."""
    wanted = os.environ.get("SWITCHBOARD_CPU_KERNELS", "auto")
    if wanted != "auto":
        if wanted not in VARIANTS:
            raise ValueError(f"SWITCHBOARD_CPU_KERNELS={wanted!r}: one of auto, {', '.join(VARIANTS)}")
        return wanted
    return next(v for v in ("amx", "avx512-vnni", "avx2") if v == "avx2" or supported(v))


def _build(cxx: str, variant: str = "avx2") -> Path:
    flags = [*FLAGS, *VARIANTS[variant]]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(" ".join([*flags, version]).encode())
    for source in [*SOURCES, *HEADERS]:
        digest.update(source.read_bytes())
    home = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()
    target = home / "kernels" / f"switchboard-cpu-{variant}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            cmd = [cxx, *flags, "-o", str(built), *map(str, SOURCES)]
            subprocess.run(cmd, capture_output=True, text=True, check=True)
            built.replace(target)  # atomic: concurrent builders each install a complete file
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernels (the build `chosen_variant` names), or None where they cannot run here."""
    return build_of(chosen_variant())


def variant() -> str | None:
    """The build the kernels run (`avx2`, `avx512-vnni` or `amx`); None where the native kernels are off.
    The AMX build where Linux refused it the tiles runs its VNNI loops, and says `avx512-vnni`."""
    lib = library()
    if lib is None:
        return None
    name = NAMES[lib.sb_variant()]
    return "avx512-vnni" if name == "amx" and not lib.sb_amx() else name


@functools.cache
def build_of(variant: str) -> ctypes.CDLL | None:
    """`variant`'s build, loaded, or None where it cannot run here (the reason is logged once)."""
    if os.environ.get("SWITCHBOARD_NATIVE_KERNELS", "1") == "0":
        return None
    if not _cpu_has_avx2():
        log.info("native kernels off: the CPU has no AVX2")
        return None
    while not supported(variant) and cpu_flags() and variant in NARROWER:
        log.warning("native kernels: this CPU cannot run the %s build; using %s", variant, NARROWER[variant])
        variant = NARROWER[variant]
    cxx = _compiler()
    if cxx is None:
        log.warning("native kernels off: no C++ compiler (g++) found; using torch's slower quantized kernels")
        return None
    while True:
        try:
            path = _build(cxx, variant)
            break
        except (OSError, subprocess.CalledProcessError) as e:
            detail = (getattr(e, "stderr", "") or str(e)).strip()[-2000:]
            if variant not in NARROWER:
                log.warning("native kernels off: building them failed: %s", detail)
                return None
            # An older compiler without -mamx-*: the narrower build still runs everything.
            log.warning("native kernels: the %s build failed (%s); using %s", variant, detail, NARROWER[variant])
            variant = NARROWER[variant]
    lib = ctypes.CDLL(str(path))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.sb_int4_linear.argtypes = [p, i, i, i, i, p, p, p, i]
    lib.sb_int8_linear.argtypes = [p, i, i, i, i, p, p, p, i, p, i, p, p, p, i]
    lib.sb_quantize_acts.argtypes = [p, i, i, i, i, i, p, p, p]
    for f in (lib.sb_int4_linear, lib.sb_int8_linear, lib.sb_quantize_acts):
        f.restype = None
    lib.sb_variant.restype = ctypes.c_int
    lib.sb_amx.restype = ctypes.c_int
    lib.sb_int4_bytes.argtypes = [i, i]
    lib.sb_int4_bytes.restype = ctypes.c_size_t
    f, long = ctypes.c_float, ctypes.c_long
    lib.sb_rms_norm.argtypes = [p, p, p, p, i, i, f, i]
    lib.sb_rope.argtypes = [p, i, p, i, long, p, p, i, i, i]
    lib.sb_silu_mul.argtypes = [p, p, i, i, i]
    lib.sb_paged_attention.argtypes = [p, long, p, i, i, i, i, p, p, p, p, i, i, i, p, p, p, f, i, i]
    for fn in (lib.sb_rms_norm, lib.sb_rope, lib.sb_silu_mul, lib.sb_paged_attention):
        fn.restype = None
    lib.sb_decoder.argtypes = [p, p, p, p]
    lib.sb_decoder.restype = ctypes.c_int
    lib.sb_lora_add.argtypes = [p, i, i, long, p, i, long, i, p, p, p, p, i, p, p, p, p, p, p, p, i, i]
    lib.sb_lora_add.restype = None
    return lib


def available() -> bool:
    return library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x as contiguous bf16 or fp32 rows, and whether it is bf16."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    return x.contiguous(), int(x.dtype == torch.bfloat16)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - t.shape[0])) if rows > t.shape[0] else t


SLAB = 16  # weight rows per slab in the kernels' layouts (int4 and int8)
SLAB4_BYTES = 320  # int4, per slab and group of 32: 16 fp16 scales, 16 fp16 mins, 256 bytes of nibbles


class Int4Weights:
    """An int4 weight in the kernel's layout (see int4_slabs.h): slabs of 16 rows, each a run of its groups of
    32 inputs; per group, the 16 rows' fp16 scales, fp16 mins (w = q·scale + min), then 256 bytes whose low
    nibbles are the group's codes in the int8 slab layout (per quad of inputs, the 16 rows' 4 codes) for its
    first 4 quads and whose high nibbles are the last 4."""

    def __init__(self, qw: QuantizedWeight) -> None:
        n, k = qw.shape
        if qw.format != "int4" or qw.group_size != GROUP or k % GROUP:
            raise ValueError(f"the native int4 kernel takes groups of {GROUP}, got {qw.format}/{qw.group_size}")
        assert qw.zeros is not None
        groups = k // GROUP
        rows = -(-n // SLAB) * SLAB
        slabs = rows // SLAB
        codes = _pad_rows(unpack_int4(qw.q).to(torch.uint8), rows)  # (rows, k)
        # (slabs, 16 rows, groups, 8 quads, 4) -> (slabs, groups, 8 quads, 16 rows, 4): the int8 slab order
        unpacked = codes.view(slabs, SLAB, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(slabs, groups, 512)
        nibbles = unpacked[..., :256] | (unpacked[..., 256:] << 4)
        scales = qw.scales.float()
        mins = qw.zeros.float() - 8 * scales  # (q - 8)·scale + zero = q·scale + (zero - 8·scale)
        head = torch.stack([_pad_rows(t, rows) for t in (scales, mins)], dim=1).to(torch.float16)  # (rows, 2, groups)
        head = head.view(slabs, SLAB, 2, groups).permute(0, 3, 2, 1).contiguous().view(torch.uint8)
        blob = torch.cat((head.view(slabs, groups, 64), nibbles), dim=2)  # (slabs, groups, 320)
        self.packed = blob.contiguous().view(-1)
        lib = library()
        assert lib is None or self.packed.numel() == lib.sb_int4_bytes(n, k), "layout size disagrees with the kernel"
        self.shape = (n, k)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


class Int8Weights:
    """A per-row int8 weight in the kernel's layout (see quant_gemm.cpp): slabs of 16 rows, each per 4
    inputs the 16 rows' 4 codes side by side (64 bytes: one zmm); one fp32 scale per row (w = q·scale).
    Calibrated weights also keep their outlier input channels' codes in fp32 (the kernel adds those
    products outside the int8 dot product)."""

    def __init__(self, qw: QuantizedWeight, act_group: int = INT8_ACT_GROUP) -> None:
        n, k = qw.shape
        if qw.format != "int8" or k % GROUP:
            raise ValueError(f"the native int8 kernel takes per-row int8 weights with K a multiple of {GROUP}")
        if act_group % GROUP or not GROUP <= act_group <= 256:
            raise ValueError(f"activation groups are a multiple of {GROUP} up to 256, not {act_group}")
        rows = -(-n // SLAB) * SLAB
        q = _pad_rows(qw.q, rows).view(rows // SLAB, SLAB, k // 4, 4).transpose(1, 2)
        self.packed = q.contiguous().view(-1)
        self.scales = _pad_rows(qw.scales.float(), rows).contiguous()
        self.act_group = act_group
        # −64 × each row's sum of codes per activation group, (slabs, groups, 16): the kernel's
        # activations are stored with +64, and its accumulators start here to take that back out.
        groups = -(-k // act_group)
        sums = torch.nn.functional.pad(qw.q.to(torch.int32), (0, groups * act_group - k))
        sums = sums.view(n, groups, act_group).sum(-1, dtype=torch.int32)
        neg = _pad_rows(-64 * sums, rows).view(rows // SLAB, SLAB, groups).transpose(1, 2)
        self.neg_offset = neg.contiguous().to(torch.int32)
        self.outliers = None if qw.outliers is None else qw.outliers.to(torch.int32).contiguous()
        # The outlier columns' codes, one row per channel, (n_out, rows): the kernel takes each channel's
        # products for 16 weight rows at once (and multiplies every row by its scale last).
        self.outlier_w = None
        if qw.outliers is not None:
            self.outlier_w = _pad_rows(qw.q[:, qw.outliers], rows).T.contiguous()
        self.shape = (n, k)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.outlier_w is None else self.outlier_w.numel()
        return self.packed.numel() + 4 * (self.scales.numel() + self.neg_offset.numel()) + extra


def _gemm_operands(
    x: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None, out_dtype: torch.dtype | None
) -> tuple[ctypes.CDLL, torch.Tensor, int, torch.Tensor, torch.Tensor | None]:
    """(library, contiguous activations, whether bf16, the output (M, N), fp32 bias) for a GEMM call."""
    lib = library()
    assert lib is not None, "native kernels are not available"
    n, k = shape
    xc, bf16 = _rows(x)
    out = torch.empty(xc.shape[0], n, dtype=out_dtype or x.dtype)
    assert out.dtype in (torch.bfloat16, torch.float32) and xc.shape[1] == k
    return lib, xc, bf16, out, None if bias is None else bias.float().contiguous()


def int4_linear(
    x: torch.Tensor, w: Int4Weights, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    lib, xc, bf16, out, b = _gemm_operands(x, w.shape, bias, out_dtype)
    (m, k), n = xc.shape, w.shape[0]
    lib.sb_int4_linear(
        xc.data_ptr(), bf16, m, k, n, w.packed.data_ptr(), _ptr(b), out.data_ptr(), int(out.dtype == torch.bfloat16)
    )
    return out


def int8_linear(
    x: torch.Tensor, w: Int8Weights, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    lib, xc, bf16, out, b = _gemm_operands(x, w.shape, bias, out_dtype)
    (m, k), n = xc.shape, w.shape[0]
    n_out = 0 if w.outliers is None else w.outliers.numel()
    lib.sb_int8_linear(
        xc.data_ptr(), bf16, m, k, n, w.packed.data_ptr(), w.scales.data_ptr(), w.neg_offset.data_ptr(), w.act_group,
        _ptr(w.outliers), n_out, _ptr(w.outlier_w), _ptr(b), out.data_ptr(), int(out.dtype == torch.bfloat16),
    )  # fmt: skip
    return out


def quantize_acts(
    x: torch.Tensor, group: int = GROUP, bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' activation quantization: (codes (M, K) int8, scales d (M, G), d·Σcodes (M, G)) for
    G groups of `group` values (the last one may be shorter). `bits=7` is the int8 kernel's form
    (codes in ±63), returned without the +64 it stores them with."""
    lib = library()
    assert lib is not None, "native kernels are not available"
    xc, bf16 = _rows(x)
    m, k = xc.shape
    groups = -(-k // group)
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, groups)
    s = torch.empty(m, groups)
    offset = 64 if bits == 7 else 0
    lib.sb_quantize_acts(xc.data_ptr(), bf16, m, k, group, offset, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q - offset, d, s


def reference_quantize_acts(
    x: torch.Tensor, group: int = GROUP, bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same activation quantization in torch: symmetric per group, round half to even."""
    top = 127.0 if bits == 8 else 63.0
    xf = x.float()
    k = xf.shape[1]
    codes, scales, sums = [], [], []
    for start in range(0, k, group):
        part = xf[:, start : start + group]
        amax = part.abs().amax(dim=-1, keepdim=True)
        # torch.full_like(...) / amax, not 127.0 / amax: torch computes a scalar over a tensor as
        # reciprocal × scalar, which rounds differently from the kernels' one division.
        inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
        q = torch.round(part * inv).to(torch.int8)
        d = amax / top
        codes.append(q)
        scales.append(d)
        sums.append(d * q.float().sum(dim=-1, keepdim=True))
    return torch.cat(codes, dim=1), torch.cat(scales, dim=1), torch.cat(sums, dim=1)
