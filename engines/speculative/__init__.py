"""Speculative decoding inside continuous batching: the proposers that draft (`proposers`: n-gram lookup or a
draft model), the lossless acceptance rule and the adaptive choice of how many to draft (`acceptance`), the
per-step glue the engine calls (`speculator`), the measured check that drafting pays (`guard`), a draft
head cut to frequent tokens (`draft_head`) and the logit distillation of a draft toward its target
(`distill`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines import lazy_exports

if TYPE_CHECKING:
    from engines.speculative.acceptance import SpecStats, accept, choose_k
    from engines.speculative.distill import DistillConfig, distill
    from engines.speculative.draft_head import frequent_token_ids
    from engines.speculative.guard import SpeedGuard
    from engines.speculative.proposers import Draft, DraftProposer, NgramProposer
    from engines.speculative.speculator import SpeculativeConfig, Speculator, build_speculator

__all__ = [
    "DistillConfig",
    "Draft",
    "DraftProposer",
    "NgramProposer",
    "SpecStats",
    "SpeculativeConfig",
    "Speculator",
    "SpeedGuard",
    "accept",
    "build_speculator",
    "choose_k",
    "distill",
    "frequent_token_ids",
]

_EXPORTS = {
    "SpecStats": "acceptance",
    "accept": "acceptance",
    "choose_k": "acceptance",
    "DistillConfig": "distill",
    "distill": "distill",
    "frequent_token_ids": "draft_head",
    "SpeedGuard": "guard",
    "Draft": "proposers",
    "DraftProposer": "proposers",
    "NgramProposer": "proposers",
    "SpeculativeConfig": "speculator",
    "Speculator": "speculator",
    "build_speculator": "speculator",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
