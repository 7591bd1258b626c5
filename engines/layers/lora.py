"""LoRA in a mixed batch: each row of a step may belong to an adapter, or to none (the bare base model).

A linear layer computes its base product for every row at once (the weights are read once per step, whatever
their format: bf16, int8, int4, a device kernel), then adds the step's adapters' low-rank deltas, each to its own
rows. As S-LoRA and Punica do, the adapters of a step are stacked so the work does not grow with their number in
operations, only in bytes: one shrink product of every row against every adapter's A (ranks are small: 8 adapters
of rank 16 on a 896-wide layer are a 128 × 896 matrix), a mask that keeps each row's own adapter's columns, then one
expand product per part of the layer (q, k, v of a fused q/k/v; gate, up) against the adapters' B side by side. The
bytes read are the step's adapters' own, once: an adapter's B has no zero blocks for the parts it leaves out.

The step's grouping (`LoraBatch`: its adapters, each row's index among them, len(names) for the base) is set by
the model runner around one forward (`lora_batch`) and read by every `Linear` that holds adapters; outside a forward,
or in a step without adapters, nothing is added. A layer keeps the stack of its last adapter sets (`LoraStacks`),
rebuilt only when a step's set changes: consecutive decode steps of the same sequences reuse it. A row's delta does
not depend on what else is in the step (matmuls of two rows or more give each row the same bits; a lone row is
run twice), so a sequence gets the same tokens in any batch.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

__all__ = ["LoraBatch", "LoraPart", "LoraStacks", "LoraWeights", "active_batch", "lora_batch", "stacked_rows"]

_KEPT_STACKS = 2  # adapter sets a layer keeps stacked: the steady decode set and one other (a joining prefill)


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
    """The adapters a step runs (`names`) and each flat row's index among them (`slots`; len(names): the bare base),
    and the row masks its layers computed (the same for every layer with the same adapters and ranks)."""

    names: tuple[str, ...]
    slots: torch.Tensor  # (rows,) int64
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)


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
class _Stack:
    """A set of adapters on one layer, side by side: A (Σ ranks, in), which adapter (index into `names`) each of
    its rows belongs to, and per distinct part (output rows) the column range of t = x·Aᵀ it reads and the Bs."""

    names: tuple[str, ...]
    a: torch.Tensor
    owner: torch.Tensor  # (Σ ranks,) int64
    parts: tuple[tuple[int, int, int, torch.Tensor], ...]  # (first output row, first column, columns, B)
    signature: tuple[int, ...]  # `owner` as a key: layers with equal ones share the step's row mask


class LoraStacks:
    """A layer's adapters (name → `LoraWeights`) and the stacks of its recent adapter sets."""

    def __init__(self) -> None:
        self.weights: dict[str, LoraWeights] = {}
        self._stacks: OrderedDict[tuple[str, ...], _Stack] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self.weights)

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    def set(self, name: str, weights: LoraWeights) -> None:
        self.weights[name] = weights
        self._stacks.clear()

    def drop(self, name: str) -> None:
        if self.weights.pop(name, None) is not None:
            self._stacks.clear()

    def add(self, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """`out` (the base product of `x`) with each row's adapter's delta added, where this layer holds it."""
        here = tuple(n for n in batch.names if n in self.weights)
        if not here:
            return out
        stack = self._stack(here)
        mask = batch.masks.get((here, stack.signature))
        if mask is None:  # once per step for every layer whose adapters and ranks are these
            local = torch.tensor([here.index(n) if n in here else -1 for n in batch.names] + [-1], device=x.device)
            rows = local[batch.slots]  # each row's index in this stack (-1 via the last entry: the base's rows)
            mask = batch.masks[(here, stack.signature)] = (rows[:, None] == stack.owner[None, :]).to(stack.a.dtype)
        lone = x.shape[0] == 1  # one row takes another matmul kernel than two or more: run it twice, keep one
        xs, mask = (x.expand(2, -1), mask.expand(2, -1)) if lone else (x, mask)
        t = (xs.to(stack.a.dtype) @ stack.a.T) * mask  # each row keeps its own adapter's columns
        delta = torch.zeros(t.shape[0], out.shape[1], dtype=t.dtype, device=t.device)
        for row, col, cols, b in stack.parts:
            delta[:, row : row + b.shape[0]] = t[:, col : col + cols] @ b.T
        return out + (delta[:1] if lone else delta).to(out.dtype)

    def _stack(self, names: tuple[str, ...]) -> _Stack:
        stack = self._stacks.get(names)
        if stack is None:
            stack = self._stacks[names] = self._build(names)
            while len(self._stacks) > _KEPT_STACKS:
                self._stacks.popitem(last=False)
        self._stacks.move_to_end(names)
        return stack

    def _build(self, names: tuple[str, ...]) -> _Stack:
        """Columns grouped by part (every adapter's rank of a part side by side), so each expand reads one slice."""
        by_part: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for i, name in enumerate(names):
            w, col = self.weights[name], 0
            for part in w.parts:
                rank = part.b.shape[1]
                by_part.setdefault(part.row, []).append((i, w.a[col : col + rank], part.b))
                col += rank
        a_rows, owners, parts, col = [], [], [], 0
        for row in sorted(by_part):
            pieces = by_part[row]
            width = sum(piece[1].shape[0] for piece in pieces)
            parts.append((row, col, width, torch.cat([b for _, _, b in pieces], dim=1).contiguous()))
            for i, a, _ in pieces:
                a_rows.append(a)
                owners += [i] * a.shape[0]
            col += width
        # On a CPU the deltas run in fp32: torch's unpacked bf16 matmuls of these shapes took a slow path (1.2 ms a
        # call inside a step on Zen 5; fp32's 16 × 128 × 4864 expand ~0.25 ms standalone); the stack's bytes double
        # (8 rank-16 adapters of the 0.5B: 141 MB in bf16 against its 494 MB of int8 weights).
        dtype = torch.float32 if a_rows[0].device.type == "cpu" else a_rows[0].dtype
        a = torch.cat(a_rows).to(dtype).contiguous()
        parts = [(row, c, w, b.to(dtype)) for row, c, w, b in parts]
        return _Stack(names, a, torch.tensor(owners, device=a.device), tuple(parts), tuple(owners))


def stacked_rows(names: Mapping[str, list[int]], total: int, device: torch.device) -> LoraBatch:
    """The batch of a step whose adapters own these flat rows (the rest are the base's)."""
    order = tuple(sorted(names))
    slots = torch.full((total,), len(order), dtype=torch.int64)  # len(order): the base, read as -1 by `local`
    for i, name in enumerate(order):
        slots[names[name]] = i
    return LoraBatch(order, slots.to(device))
