"""The multi-LoRA Triton kernels (`engines.kernels.triton_lora`) under the interpreter: against each row's delta
computed alone in float64, rows of the bare base left untouched, every row's bits independent of its batch, and
`LayerAdapters` on the Triton backend against the CPU's own path; mutants show each check can fail; the kernels
lower to sm_90 for bf16.

Tiny shapes (in 200: two K blocks of 128; out 24 and 40) keep the interpreter fast."""

from __future__ import annotations

import triton_support  # isort: skip  (first: it sets TRITON_INTERPRET before the kernel module is imported)

from pathlib import Path

import pytest
import torch

from engines.kernels import backends, triton_lora
from engines.kernels.backends import TritonBackend
from engines.layers.lora import LayerAdapters, LoraBatch, LoraPart, LoraWeights

IN = 200
RANKS = (8, 4, 16)  # three adapters, each of one part


def stacks(n: int, ranks: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = max(ranks)
    a = torch.zeros(len(ranks), width, IN)
    b = torch.zeros(len(ranks), n, width)
    for s, r in enumerate(ranks):  # the padding stays zero, as LayerAdapters.stacked leaves it
        a[s, :r] = torch.randn(r, IN, generator=gen) / IN**0.5
        b[s, :, :r] = torch.randn(n, r, generator=gen)
    return a, b


def expected(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int]) -> torch.Tensor:
    want = out.double().clone()
    for r, s in enumerate(slots):
        if s >= 0:
            want[r] += (x[r].double() @ a[s].double().T) @ b[s].double().T
    return want.to(out.dtype)


def run(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int]) -> torch.Tensor:
    got = out.clone()
    triton_lora.lora_add(x, got, a, b, torch.tensor(slots, dtype=torch.int32))
    return got


def check(dtype: torch.dtype = torch.float32, n: int = 24) -> None:
    gen = torch.Generator().manual_seed(7)
    slots = [0, -1, 2, 1, 0, -1, 2]
    x, out = torch.randn(len(slots), IN, generator=gen).to(dtype), torch.randn(len(slots), n, generator=gen).to(dtype)
    a, b = stacks(n, RANKS)
    got = run(x, out, a.to(dtype), b.to(dtype), slots)
    torch.testing.assert_close(got, expected(x, out, a.to(dtype), b.to(dtype), slots), rtol=1e-5, atol=1e-5)
    for r, s in enumerate(slots):
        if s < 0:
            assert torch.equal(got[r], out[r])  # the bare base's rows: not even rounded again


def test_each_row_gets_its_own_adapters_delta_and_base_rows_nothing() -> None:
    check()
    check(n=40)  # a width that is no power of two: the last columns masked


def test_a_rows_bits_do_not_depend_on_its_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    slots = [2, 0, 1, 2, 2, -1, 0, 1]
    x, out = torch.randn(len(slots), IN, generator=gen), torch.randn(len(slots), 24, generator=gen)
    a, b = stacks(24, RANKS)
    together = run(x, out, a, b, slots)
    for r, s in enumerate(slots):
        alone = run(x[r : r + 1], out[r : r + 1], a, b, [s])
        assert torch.equal(alone[0], together[r])


@pytest.mark.parametrize(
    ("kernel", "old", "new"),
    [
        ("_shrink_kernel", "acc += tl.sum(a * x[None, :], axis=1)", "acc = tl.sum(a * x[None, :], axis=1)"),  # last K
        ("_expand_kernel", "(base + delta)", "(delta)"),  # the base product dropped
        ("_expand_kernel", "slot.to(tl.int64) * stride_slot", "0 * stride_slot"),  # every row on slot 0's B
    ],
)
def test_broken_kernels_fail(monkeypatch: pytest.MonkeyPatch, kernel: str, old: str, new: str) -> None:
    triton_support.poison_new_buffers(monkeypatch)
    monkeypatch.setattr(triton_lora, kernel, triton_support.mutant(triton_lora, kernel, old, new))
    with pytest.raises(AssertionError):
        check()


def layer(seed: int) -> LayerAdapters:
    """A fused q/k/v-like layer (out 12 + 6 + 6) holding two adapters: one training q and v (ranks 4), one every
    part (rank 8)."""
    gen = torch.Generator().manual_seed(seed)
    adapters = LayerAdapters()
    for name, parts in (("qv", ((0, 12, 4), (18, 6, 4))), ("all", ((0, 12, 8), (12, 6, 8), (18, 6, 8)))):
        a = torch.randn(sum(r for _, _, r in parts), IN, generator=gen) / IN**0.5
        bs = tuple(LoraPart(row, torch.randn(n, r, generator=gen)) for row, n, r in parts)
        adapters.set(name, LoraWeights(a, bs))
    return adapters


def test_layer_adapters_on_the_triton_backend_match_the_cpus_path() -> None:
    gen = torch.Generator().manual_seed(11)
    x, out = torch.randn(6, IN, generator=gen), torch.randn(6, 24, generator=gen)
    batch = LoraBatch.of({"qv": [0, 3], "all": [1, 4, 5], "missing": [2]})  # row 2: an adapter this layer lacks
    want = layer(1).add(x, out.clone(), batch)
    backends.use("cpu", TritonBackend())
    try:
        adapters = layer(1)
        got = adapters.add(x, out.clone(), batch)
        again = adapters.add(x, out.clone(), batch)  # the stacked weights kept for the step's adapter set
    finally:
        backends.use("cpu", None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], out[2]) and torch.equal(again, got)
    assert list(batch._slots) == [(("all", "qv"), 6)]  # the rows' slots made once for the step, not per call
    assert not torch.allclose(got[[0, 1, 3, 4, 5]], out[[0, 1, 3, 4, 5]])


def test_kernels_compile_for_the_gpu(tmp_path: Path) -> None:
    """Both kernels lower to sm_90 for bf16 weights and activations, at the widest rank a fused q/k/v of rank 64
    gives (192 → BLOCK_R 256)."""
    shrink = dict.fromkeys(["x_ptr", "a_ptr"], "*bf16") | {"slot_ptr": "*i32", "t_ptr": "*fp32"}
    expand = {"t_ptr": "*fp32", "b_ptr": "*bf16", "slot_ptr": "*i32", "out_ptr": "*bf16"}
    cases = [
        ("_shrink_kernel", shrink, {"BLOCK_R": 256, "BLOCK_K": 32}),
        ("_expand_kernel", expand, {"BLOCK_R": 256, "BLOCK_N": 32}),
    ]
    ptx = triton_support.compile_for_h100("engines.kernels.triton_lora", cases, tmp_path)
    assert len(ptx) == 2 and all("ld.global" in p for p in ptx)
