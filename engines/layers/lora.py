"""LoRA in a mixed batch: each row of a step may belong to an adapter, or to none (the bare base model).

A linear layer computes its base product for every row at once (the weights are read once per step, whatever
their format: bf16, int8, int4, a device kernel), then adds each of the step's adapters' low-rank delta to that
adapter's rows only, as S-LoRA's and Punica's grouped products do: the adapter's rows gathered, one shrink
product against its A (rank × in), one expand product per part of the layer it trains (q, k, v of a fused q/k/v;
gate, up) against that part's B, added into the part's output columns of those rows. No row is multiplied by
another adapter's weights (or by zeros standing in for them), so the work is the rows' own: 16 rows over 8 rank-16
adapters cost what 16 rows of one adapter do, in more but smaller products.

A row's delta depends on nothing else in the step: each product has its adapter's fixed shapes but for the row
count, and matmuls of two rows or more give each row the same bits whatever their number (a lone row is run twice,
since one row takes another kernel). So a sequence gets the same tokens in any batch, even in bf16, where a delta
that differed in its last fp32 bit would round some sums the other way and, a few tokens on, change the greedy
choice (measured: stacking every adapter's A side by side did exactly that on SmolLM2 in bf16).

The step's grouping (`LoraBatch`: its adapters and each one's flat rows) is set by the model runner around one
forward (`lora_batch`) and read by every `Linear` that holds adapters; outside a forward, or in a step without
adapters, nothing is added.

Where: our C++ kernel on a CPU that has the library (`cpu_ops.lora_add`); the Triton kernels where the device's
backend is Triton (a CUDA GPU: `engines.kernels.triton_lora`, every adapter of the step in two launches, each row
reading its own adapter's stacked weights); torch's grouped products elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from engines.kernels import cpu_kernels, cpu_ops
from engines.kernels.backends import backend_for

__all__ = ["LayerAdapters", "LoraBatch", "LoraPart", "LoraWeights", "active_batch", "lora_batch"]

_KEPT_PLANS = 4  # adapter sets a layer keeps the kernel's arguments for: the steady decode set, a joining prefill


@dataclass(frozen=True)
class LoraPart:
    """One part of a layer's output an adapter trains: output rows [row, row + b.shape[0]), its B (rows, rank)."""

    row: int
    b: torch.Tensor  # the scale folded in


@dataclass(frozen=True)
class LoraWeights:
    """One adapter on one linear layer: A (Σ ranks, in), its parts' A rows stacked in the parts' order, and the
    parts (each part's rank is its B's width)."""

    a: torch.Tensor
    parts: tuple[LoraPart, ...]


@dataclass(frozen=True)
class LoraBatch:
    """The adapters a step runs (`names`) and each one's flat rows (`rows[i]`: int64 indices; other rows are the
    bare base's)."""

    names: tuple[str, ...]
    rows: tuple[torch.Tensor, ...]
    _slots: dict[tuple[tuple[str, ...], int], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, rows: Mapping[str, list[int]], device: torch.device | str = "cpu") -> LoraBatch:
        """The batch whose adapters own these flat rows, adapters in name order."""
        names = tuple(sorted(rows))
        return cls(names, tuple(torch.tensor(rows[n], dtype=torch.int64, device=device) for n in names))

    @classmethod
    def every_row(cls, name: str, count: int, device: torch.device | str = "cpu") -> LoraBatch:
        """All `count` rows under adapter `name`."""
        return cls((name,), (torch.arange(count, device=device),))

    def slots(self, held: tuple[str, ...], count: int, device: torch.device) -> torch.Tensor:
        """Each of the `count` flat rows' slot among `held` (the adapters of this batch a layer holds, slot i =
        held[i]), -1 for the others (int32, for the Triton kernels): made once per step for every layer holding the
        same adapters, not once per layer."""
        got = self._slots.get((held, count))
        if got is None:
            got = torch.full((count,), -1, dtype=torch.int32, device=device)
            for slot, name in enumerate(held):
                got[self.rows[self.names.index(name)].to(device)] = slot
            self._slots[(held, count)] = got
        return got


_active: contextvars.ContextVar[LoraBatch | None] = contextvars.ContextVar("lora_batch", default=None)


def active_batch() -> LoraBatch | None:
    return _active.get()


@contextlib.contextmanager
def lora_batch(batch: LoraBatch | None) -> Iterator[None]:
    """Every `Linear` holding adapters adds their deltas to the rows `batch` gives them, inside this block."""
    token = _active.set(batch if batch is not None and batch.names else None)
    try:
        yield
    finally:
        _active.reset(token)


@dataclass(frozen=True)
class _Served:
    """One adapter on one layer as the deltas compute it. On a CPU with our kernels (`native`): A (rank × in) and
    per part (first output row, first column of t = x·Aᵀ, rank, Bᵀ as rank × rows), in the dtype they were loaded
    in (bf16 or fp32), for `engines.kernels.cpu_ops.lora_add`; elsewhere fp32 A and B as `_pack` leaves them for
    `_product`."""

    a: torch.Tensor
    parts: tuple[tuple[int, int, int, torch.Tensor], ...]
    dtype: torch.dtype
    native: bool


def _on_cpu_packed() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _pack(w: torch.Tensor) -> torch.Tensor:
    """`w` (out, in) as `_product` reads it: oneDNN's blocked layout on a CPU that has it, else `w` itself.

    The fallback where our kernels are off. Why oneDNN, in fp32: the plain fp32 matmul (MKL's sgemm) of a shrink
    (rows × 576 against 16 × 576 on SmolLM2) gives a row other bits once there are 16 rows or more (measured on
    Xeon and Zen 5), which made a sequence's bf16 tokens depend on how many others shared its adapter; oneDNN's
    inner product gave every row the same bits for 1-64 rows, and bf16 matmuls of these shapes took a slow path
    (1.2 ms a call inside a step on Zen 5)."""
    if w.device.type == "cpu" and _on_cpu_packed():
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
    return w.contiguous()


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x · wᵀ for a weight from `_pack`."""
    if x.device.type == "cpu" and _on_cpu_packed():
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return x @ w.T


def _native(device: torch.device) -> bool:
    return device.type == "cpu" and cpu_kernels.library() is not None


class LayerAdapters:
    """A layer's adapters by name (`weights`, as loaded), their delta-ready copies, and the kernel's fixed
    arguments for the adapter sets of recent steps."""

    def __init__(self) -> None:
        self.weights: dict[str, LoraWeights] = {}
        self._served: dict[str, _Served] = {}
        self._plans: OrderedDict[tuple[str, ...], cpu_ops.LoraPlan] = OrderedDict()
        self._stacks: OrderedDict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self.weights)

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    def set(self, name: str, weights: LoraWeights) -> None:
        self.weights[name] = weights
        cpu, native = weights.a.device.type == "cpu", _native(weights.a.device)
        # Our kernel reads the weights as loaded (bf16 for a bf16 model: half the bytes) and computes in fp32;
        # torch's products on a CPU run in fp32 copies (its bf16 ones took a slow path here).
        kept = weights.a.dtype if native and weights.a.dtype in (torch.bfloat16, torch.float32) else torch.float32
        dtype = kept if cpu else weights.a.dtype
        parts, col = [], 0
        for part in weights.parts:
            rank = part.b.shape[1]
            b = part.b.to(dtype)
            parts.append((part.row, col, rank, b.T.contiguous() if native else _pack(b)))
            col += rank
        a = weights.a.to(dtype).contiguous() if native else _pack(weights.a.to(dtype))
        self._served[name] = _Served(a, tuple(parts), dtype, native)
        self._plans.clear()
        self._stacks.clear()

    def drop(self, name: str) -> None:
        self.weights.pop(name, None)
        self._served.pop(name, None)
        self._plans.clear()
        self._stacks.clear()

    def add(self, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """`out` (the base product of `x`) with each row's adapter's delta added, where this layer holds it."""
        here = [(name, rows) for name, rows in zip(batch.names, batch.rows, strict=True)
                if name in self._served and rows.numel()]  # fmt: skip
        if not here:
            return out
        if backend_for(x).name == "triton":
            from engines.kernels import triton_lora

            names = tuple(name for name, _ in here)
            slots = batch.slots(names, x.shape[0], x.device)
            triton_lora.lora_add(x, out, *self.stacked(names, out.shape[1]), slots)
            return out
        if self.native_for(batch) and x.dtype in (torch.bfloat16, torch.float32) and out.dtype == x.dtype:
            x, out = x.contiguous(), out.contiguous()
            cpu_ops.lora_add(x, out, self.plan(batch.names, x.shape[1]), list(batch.rows))
            return out
        for name, rows in here:
            served = self._served[name]
            lone = rows.numel() == 1  # one row takes another matmul kernel than two or more: run it twice, keep one
            picked = rows.expand(2) if lone else rows
            t = _product(x.index_select(0, picked).to(served.dtype), served.a)
            for row, col, rank, b in served.parts:
                delta = _product(t[:, col : col + rank].contiguous(), b)
                part = out[:, row : row + b.shape[0]]
                part.index_add_(0, rows, (delta[:1] if lone else delta).to(out.dtype))
        return out

    def stacked(self, names: tuple[str, ...], out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The Triton kernels' weights for adapters `names` (all held here), slot i = names[i]: A (slots, R, in)
        and B (slots, out, R), R the widest adapter's rank sum, each part's B in its own output rows and columns of
        t = x·Aᵀ, zeros elsewhere (they add exactly nothing)."""
        stack = self._stacks.get(names)
        if stack is None:
            weights = [self.weights[n] for n in names]
            first = weights[0].a
            width = max(w.a.shape[0] for w in weights)
            a = torch.zeros(len(names), width, first.shape[1], dtype=first.dtype, device=first.device)
            b = torch.zeros(len(names), out_features, width, dtype=first.dtype, device=first.device)
            for slot, w in enumerate(weights):
                a[slot, : w.a.shape[0]] = w.a
                col = 0
                for part in w.parts:
                    rows, rank = part.b.shape
                    b[slot, part.row : part.row + rows, col : col + rank] = part.b.to(first.dtype)
                    col += rank
            stack = self._stacks[names] = (a, b)
            while len(self._stacks) > _KEPT_PLANS:
                self._stacks.popitem(last=False)
        self._stacks.move_to_end(names)
        return stack

    def native_for(self, batch: LoraBatch) -> bool:
        """Whether our kernel computes this layer's deltas for `batch` (every adapter it holds served for it)."""
        return all(self._served[n].native for n in batch.names if n in self._served)

    def plan(self, names: tuple[str, ...], in_features: int) -> cpu_ops.LoraPlan:
        """The kernel's fixed arguments for a step whose adapters are `names` (those this layer lacks: rank 0)."""
        plan = self._plans.get(names)
        if plan is None:
            entries = [(self._served[n].a, list(self._served[n].parts)) if n in self._served else None for n in names]
            plan = self._plans[names] = cpu_ops.lora_plan(entries, in_features)
            while len(self._plans) > _KEPT_PLANS:
                self._plans.popitem(last=False)
        self._plans.move_to_end(names)
        return plan
