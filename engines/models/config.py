"""The subset of a Hugging Face `config.json` that our decoder implementations need."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
MOE_WEIGHTINGS = ("router", "none")


class UnsupportedModelError(ValueError):
    """The directory holds a model this engine cannot run."""


@dataclass(frozen=True)
class MoEConfig:
    """Sparse MoE (Qwen2-MoE / Mixtral); num_experts = 0 is a dense model."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # "router": experts weighted by their renormalised router probabilities (Qwen2-MoE, Mixtral);
    # "none": selected experts (and the shared one) simply summed, as when a dense MLP was split into
    # experts (`engines.checkpoints.moe_build`). Our own config key: `switchboard_moe_weighting`.
    moe_weighting: str = "router"

    def is_sparse_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape; its MoE fields are in `moe`, and read as attributes too (`cfg.num_experts`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    moe: MoEConfig = MoEConfig()

    def is_sparse_layer(self, layer: int) -> bool:
        return self.moe.is_sparse_layer(layer)

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architectures {archs!r} not supported; this engine runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported yet")
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention is not supported yet")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"activation {cfg.get('hidden_act')!r} is not supported")
        heads = cfg["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always carries q/k/v biases; Llama only when the config says so.
            attention_bias=arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
            or bool(cfg.get("attention_bias", False)),
            moe=_moe_config(arch, cfg),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{model_dir} has no config.json; is it a Hugging Face model directory?")
        return cls.from_dict(json.loads(path.read_text()))


def _moe_config(arch: str, cfg: dict) -> MoEConfig:
    if arch == "Qwen2MoeForCausalLM":
        fields = dict(
            num_experts=cfg["num_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )
    elif arch == "MixtralForCausalLM":  # softmax over the top-k logits: renormalised top-k probabilities
        fields = dict(
            num_experts=cfg["num_local_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["intermediate_size"],
        )
    else:
        return MoEConfig()
    weighting = cfg.get("switchboard_moe_weighting", "router")
    if weighting not in MOE_WEIGHTINGS:
        raise UnsupportedModelError(f"switchboard_moe_weighting {weighting!r} is not one of {MOE_WEIGHTINGS}")
    if not 0 < fields["num_experts_per_tok"] <= fields["num_experts"]:
        raise UnsupportedModelError("num_experts_per_tok must be between 1 and num_experts")
    return MoEConfig(**fields, moe_weighting=weighting)


def _moe_field(name: str) -> property:
    return property(lambda self: getattr(self.moe, name), doc=f"`moe.{name}`")


for _name in MoEConfig.__dataclass_fields__:  # `cfg.num_experts`, as before the grouping
    setattr(ModelConfig, _name, _moe_field(_name))
