"""LoRA in a mixed batch: each row of a step may belong to an adapter, or to none (the bare base model).

A linear layer computes its base product for every row at once (the weights are read once per step, whatever
their format: bf16, int8, int4, a device kernel), then adds each adapter's low-rank delta to that adapter's rows
only: y[rows] += (x[rows] @ Aᵀ) @ Bᵀ, one pair of small products per adapter in the step, as S-LoRA and Punica
group them. The rank is small (16: a 1,536-wide projection's delta costs ~2% of its base product), so the delta
runs in the activations' dtype with torch's own matmuls on any device; the base kernels are untouched.

The step's grouping (`LoraBatch`: adapter → the flat row indices) is set by the model runner around one forward
(`lora_batch`) and read by every `Linear` that holds adapters; outside a forward, or in a step without adapters,
nothing is added. A fused layer (q/k/v, gate/up) holds one pair per adapter: its parts' A matrices stacked and
their B matrices block-diagonal, so a part the adapter does not train gets zeros (`engines.lora.adapter`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

__all__ = ["LoraBatch", "LoraWeights", "active_batch", "add_lora", "lora_batch"]


@dataclass(frozen=True)
class LoraWeights:
    """One adapter's pair on one linear layer: A (rank, in), B (out, rank), its scale folded into B."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LoraBatch:
    """The step's rows by adapter name (flat row indices into the forward's tokens); rows of no adapter absent."""

    rows: Mapping[str, torch.Tensor]


_active: contextvars.ContextVar[LoraBatch | None] = contextvars.ContextVar("lora_batch", default=None)


def active_batch() -> LoraBatch | None:
    return _active.get()


@contextlib.contextmanager
def lora_batch(batch: LoraBatch | None) -> Iterator[None]:
    """Every `Linear` holding adapters adds their deltas to the rows `batch` gives them, inside this block."""
    token = _active.set(batch if batch is not None and batch.rows else None)
    try:
        yield
    finally:
        _active.reset(token)


def add_lora(x: torch.Tensor, out: torch.Tensor, weights: Mapping[str, LoraWeights], batch: LoraBatch) -> torch.Tensor:
    """`out` (the base product of `x`) with each adapter's delta added to its rows. An adapter of the step that this
    layer holds no pair for (it does not train the layer) adds nothing."""
    for name, rows in batch.rows.items():
        pair = weights.get(name)
        if pair is None:
            continue
        part = x.index_select(0, rows)
        delta = (part @ pair.a.T) @ pair.b.T
        out = out.index_add(0, rows, delta.to(out.dtype))
    return out
