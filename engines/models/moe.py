"""The sparse Mixture-of-Experts MLP of Qwen2-MoE and Mixtral decoders (`engines.models.qwen2`, `.mixtral`).

Each sparse layer's MLP is a router (a linear map to one logit per expert), E SwiGLU experts and,
in Qwen2-MoE, a shared expert every token passes through (scaled by a sigmoid gate). A token goes to
its top-k experts by router probability, renormalised over those k when the config says so (Mixtral
always); `moe_weighting = "none"` sums the chosen experts unweighted (a dense MLP split into experts).

Compute is grouped by expert, never looped per token (the device's backend: the torch path is
`engines.kernels.reference.grouped_experts`): the (token, expert) pairs are sorted by expert, each expert
runs once on all of its tokens, and the weighted results are added back into their rows. A step reads
only the experts some token in it chose, which is where decode saves bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.kernels.backends import backend_for
from engines.layers.blocks import SwiGLU
from engines.layers.linear import Linear
from engines.models.config import ModelConfig


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.num_experts = moe.num_experts
        self.top_k = moe.num_experts_per_tok
        self.normalize = moe.norm_topk_prob or cfg.architecture == "MixtralForCausalLM"
        self.weighted = moe.moe_weighting == "router"
        self.gate = Linear(cfg.hidden_size, moe.num_experts)  # the router; never quantized
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, moe.moe_intermediate_size) for _ in range(moe.num_experts))
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = SwiGLU(cfg.hidden_size, shared) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1) if shared and self.weighted else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (T, k) in x's dtype, expert ids (T, k)) of each token's chosen experts."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if not self.weighted:
            return torch.ones_like(weights, dtype=x.dtype), ids
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = backend_for(x).moe_experts(self, x, weights, ids)
        if self.shared_expert is not None:
            shared = _run(self.shared_expert, x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out += shared
        return out

    def run_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s SwiGLU on its tokens' rows `x` (the grouped torch path runs each expert once)."""
        return _run(self.experts[expert], x)


def _run(mlp: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    """A float matmul takes another kernel for one row than for several (whose rows are identical at
    any count; see `engines.model_runner`): a lone bf16 row runs twice so an expert's output for a
    token does not depend on how many others chose it."""
    if x.shape[0] == 1 and x.dtype == torch.bfloat16 and mlp.gate_up_proj.format == "bf16":
        return mlp(x.expand(2, -1).contiguous())[:1]
    return mlp(x)
