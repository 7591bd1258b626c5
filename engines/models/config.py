"""The subset of a Hugging Face `config.json` that our decoder implementations need.

One `ModelConfig` describes every family: the structural switches (q/k norm, Gemma's norms, GELU-tanh,
sliding-window layers with their own RoPE, embedding and attention scales, logit soft-capping) are fields,
set by `from_dict` from what each architecture's config says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engines.layers.blocks import ACTIVATIONS
from engines.layers.rope_scaling import RopeScaling, UnsupportedRopeError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma3ForCausalLM",
)
MOE_WEIGHTINGS = ("router", "none")
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")


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
class FamilyFeatures:
    """What the families built on the Llama layer switch on; read as attributes of `ModelConfig` too."""

    rope: RopeScaling | None = None  # None: plain RoPE at rope_theta
    # Per layer: how many positions (its own included) a query sees; 0 = all (global attention).
    windows: tuple[int, ...] = ()
    local_rope: RopeScaling | None = None  # the sliding-window layers' own RoPE (Gemma 3); None: `rope`
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    gemma_norms: bool = False  # (1 + w) RMSNorms, post-attention and post-MLP norms too (Gemma 3)
    hidden_act: str = "silu"
    embed_scale: float = 1.0  # embeddings times this (Gemma: √hidden, rounded to the weights' dtype)
    attn_scale: float | None = None  # scores' scale; None: head_dim^-0.5
    final_logit_softcap: float | None = None  # logits = cap · tanh(logits / cap)


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape; its MoE fields are in `moe`, its families' switches in `features`, both read as
    attributes too (`cfg.num_experts`, `cfg.qk_norm`)."""

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
    features: FamilyFeatures = FamilyFeatures()

    def is_sparse_layer(self, layer: int) -> bool:
        return self.moe.is_sparse_layer(layer)

    def window(self, layer: int) -> int:
        """Positions layer `layer` attends to (its own included); 0: all of them."""
        return self.windows[layer] if self.windows else 0

    @property
    def rope_scaling(self) -> RopeScaling:
        return self.rope or RopeScaling(theta=self.rope_theta)

    @property
    def plain_llama(self) -> bool:
        """The Llama layer and nothing more: what the fused whole-decoder path (`native_decoder`) runs."""
        return self.features == FamilyFeatures(rope=self.features.rope)  # any RoPE: its tables are shared

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architectures {archs!r} not supported; this engine runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = arch == "Gemma3ForCausalLM"
        max_positions = cfg.get("max_position_embeddings", 2048)
        rope, local_rope = _ropes(cfg, gemma, max_positions)
        act = (
            (cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
            if gemma
            else cfg.get("hidden_act", "silu")
        )
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {act!r} is not supported; this engine runs {ACTIVATIONS}")
        if cfg.get("attn_logit_softcapping") is not None:
            raise UnsupportedModelError("attention logit soft-capping (Gemma 2) is not supported")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        scalar = cfg.get("query_pre_attn_scalar")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            # Qwen2 always carries q/k/v biases; Llama only when the config says so.
            attention_bias=arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
            or bool(cfg.get("attention_bias", False)),
            moe=_moe_config(arch, cfg),
            features=FamilyFeatures(
                rope=None if rope.rope_type == "default" and local_rope is None else rope,
                windows=_windows(arch, cfg),
                local_rope=local_rope,
                qk_norm=arch in QK_NORM,
                gemma_norms=gemma,
                hidden_act=act,
                embed_scale=hidden**0.5 if gemma else 1.0,
                attn_scale=float(scalar) ** -0.5 if gemma and scalar and scalar != head_dim else None,
                final_logit_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            ),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{model_dir} has no config.json; is it a Hugging Face model directory?")
        return cls.from_dict(json.loads(path.read_text()))


def _ropes(cfg: dict, gemma: bool, max_positions: int) -> tuple[RopeScaling, RopeScaling | None]:
    """(the global layers' RoPE, the sliding layers' own or None). transformers 5 writes `rope_parameters`,
    per layer type where they differ (Gemma 3); older configs `rope_theta` and `rope_scaling` (and Gemma 3's
    `rope_local_base_freq`)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta", 10000.0)
    try:
        if "full_attention" in params or "sliding_attention" in params:
            full = RopeScaling.from_dict(params.get("full_attention"), theta, max_positions)
            local = params.get("sliding_attention")
            return full, None if local is None else RopeScaling.from_dict(local, theta, max_positions)
        full = RopeScaling.from_dict(params, theta, max_positions)
        if gemma:
            return full, RopeScaling(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
        return full, None
    except UnsupportedRopeError as e:
        raise UnsupportedModelError(str(e)) from None


def _windows(arch: str, cfg: dict) -> tuple[int, ...]:
    """Each layer's attention window (0: global) from `layer_types` where the config lists them, else as
    each architecture derives it: Mistral every layer; Qwen2/3 layers from `max_window_layers` on when
    `use_sliding_window`; Gemma 3 all but every `sliding_window_pattern`-th."""
    layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") or 0
    if arch.startswith("Qwen") and not cfg.get("use_sliding_window"):
        window = 0  # Qwen configs carry a sliding_window they do not use
    if not window:
        return ()
    if types := cfg.get("layer_types"):
        if len(types) != layers:
            raise UnsupportedModelError(f"layer_types lists {len(types)} layers, the model has {layers}")
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    if arch == "Gemma3ForCausalLM":
        pattern = cfg.get("sliding_window_pattern", 6)
        return tuple(window if (i + 1) % pattern else 0 for i in range(layers))
    if arch.startswith("Qwen"):
        first = cfg.get("max_window_layers", layers)
        return tuple(window if i >= first else 0 for i in range(layers))
    return (window,) * layers


def _moe_config(arch: str, cfg: dict) -> MoEConfig:
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        fields = dict(
            num_experts=cfg.get("num_experts") or cfg["num_local_experts"],  # transformers 5 renamed it
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


def _feature_field(name: str) -> property:
    return property(lambda self: getattr(self.features, name), doc=f"`features.{name}`")


for _name in MoEConfig.__dataclass_fields__:  # `cfg.num_experts`, as before the grouping
    setattr(ModelConfig, _name, _moe_field(_name))
for _name in FamilyFeatures.__dataclass_fields__:  # `cfg.qk_norm`
    setattr(ModelConfig, _name, _feature_field(_name))
