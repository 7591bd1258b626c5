"""The Llama decoder (SmolLM2 and friends): RMSNorm, RoPE, grouped-query attention, SwiGLU; and, switched on
by its config, what the families built on it add (`engines.models.config.ModelConfig`): q/k norms (Qwen3,
Gemma 3), sliding-window layers with their own RoPE (Mistral, Gemma 3), Gemma's (1 + w) norms around both
attention and MLP, GELU-tanh, scaled embeddings and soft-capped logits.

Tensors are flat over tokens, (num_tokens, ...), so one forward can later carry many sequences. The
attention layer (`engines.layers.attention`) runs the step's backend, so paged and Triton variants can
replace it without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engines.kernels.metadata import AttentionBackend, AttentionMetadata
from engines.layers.attention import SelfAttention
from engines.layers.blocks import OffsetRMSNorm, RMSNorm, RotaryEmbedding, SwiGLU
from engines.layers.linear import Embedding, Linear
from engines.layers.lora import active_batch
from engines.models.config import ModelConfig
from engines.models.moe import SparseMoE
from engines.models.native_decoder import NativeDecoder, enabled


@dataclass
class HiddenTaps:
    """Rows of the residual stream to keep as a forward runs: layer → flat row indices, where layer L is
    the stream after L decoder layers (0: the embeddings), before the final norm: Hugging Face's
    `hidden_states[L]` for L < num_layers. `forward` fills `states` (float32, (rows, hidden))."""

    rows: dict[int, list[int]]
    states: dict[int, torch.Tensor] = field(default_factory=dict)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        norm = OffsetRMSNorm if cfg.gemma_norms else RMSNorm
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            layer_idx,
            bias=cfg.attention_bias,
            qk_norm=norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None,
            window=cfg.window(layer_idx),
            scale=cfg.attn_scale,
        )
        self.local = bool(cfg.window(layer_idx)) and cfg.local_rope is not None  # the local RoPE's layer
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.gemma_norms:  # Gemma: the attention's output normed; the MLP between two norms of its own
            self.pre_feedforward_layernorm: RMSNorm | None = norm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm: RMSNorm | None = norm(cfg.hidden_size, cfg.rms_norm_eps)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if cfg.is_sparse_layer(layer_idx):
            self.mlp: nn.Module = SparseMoE(cfg)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next norm adds the two, so
        each residual add is fused with the norm that follows it."""
        hidden, residual = self.input_layernorm.add_norm(hidden, residual)
        hidden = self.self_attn(hidden, rope, backend, meta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm.add_norm(hidden, residual)
            return self.mlp(hidden), residual
        hidden, residual = self.pre_feedforward_layernorm.add_norm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_scaling, cfg.max_position_embeddings)
        self.local_rope = (
            None
            if cfg.local_rope is None
            else RotaryEmbedding(cfg.head_dim, cfg.local_rope, cfg.max_position_embeddings)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = (OffsetRMSNorm if cfg.gemma_norms else RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._native_key: tuple | None = None
        self._native: NativeDecoder | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
        taps: HiddenTaps | None = None,
    ) -> torch.Tensor:
        """Final hidden states, (num_tokens, hidden); `compute_logits` turns the rows you need into logits.
        `taps`: residual-stream rows to keep on the way (a router's features)."""
        hidden = self.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:  # HF rounds the scale to the weights' dtype first
            hidden = hidden * torch.tensor(self.config.embed_scale, dtype=hidden.dtype)
        rope = self.rope(positions)
        local = None if self.local_rope is None else self.local_rope(positions)
        # A step's LoRA deltas run inside the library's call where our kernel serves them (else layer by layer).
        lora = active_batch()
        native = self._native_decoder(backend) if taps is None else None
        if native is not None and native.supports(lora):  # every layer in one call: the same numbers, no Python
            hidden, residual = native.forward(hidden, rope, meta, lora)
            return self.norm.add_norm(hidden, residual)[0]
        residual = None
        if taps is not None and 0 in taps.rows:
            taps.states[0] = hidden[taps.rows[0]].float()
        for i, layer in enumerate(self.layers, 1):
            layer_rope = local if layer.local and local is not None else rope
            hidden, residual = layer(hidden, residual, layer_rope, backend, meta)
            if taps is not None and i in taps.rows:  # the stream is the layer's output plus its residual
                rows = taps.rows[i]
                taps.states[i] = hidden[rows].float() + residual[rows].float()
        return self.norm.add_norm(hidden, residual)[0]

    def _native_decoder(self, backend: AttentionBackend) -> NativeDecoder | None:
        """`engines.models.native_decoder` for this backend and these kernels, built once (None where it
        cannot run); rebuilt when the backend, its cache or the layers' kernels change."""
        if not enabled() or self.device.type != "cpu" or not self.config.plain_llama:
            return None
        cache = getattr(backend, "cache", None)
        first, last = self.layers[0], self.layers[-1]
        kernels = (
            getattr(first.self_attn.qkv_proj, "kernel", None),
            getattr(getattr(last.mlp, "down_proj", None), "kernel", None),
        )
        key = (id(backend), None if cache is None else cache.buffer.data_ptr(), *map(id, kernels))
        if self._native_key != key:
            self._native_key, self._native = key, NativeDecoder.build(self, backend)
        return self._native

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cap_logits(self.lm_head(hidden).float())

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's float logits as the model gives them: soft-capped where the config says (Gemma)."""
        if (cap := self.config.final_logit_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm is never quantized)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def weights_format(self) -> str:
        """bf16, or the format most of the decoder's linear bytes are in."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            for module in layer.modules():
                if isinstance(module, Linear):
                    counts[module.format] = counts.get(module.format, 0) + module.in_features * module.out_features
        return max(counts, key=counts.__getitem__) if counts else "bf16"

    def build_rope(self, dtype: torch.dtype) -> None:
        """The RoPE tables (the sliding layers' own too, where they have one) in `dtype`."""
        for rope in (self.rope, self.local_rope):
            if rope is not None:
                rope.build(dtype, self.device)

    def prepare(self) -> None:
        """Once the weights are in: build the RoPE tables and let every linear layer pick its kernel."""
        self.build_rope(self.dtype)
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare(shared=module is self.lm_head and self.config.tie_word_embeddings)
