"""The engine: requests in, one `step` at a time, outputs out.

v0 runs each unfinished sequence forward by one pass per step (its whole prompt first, then one token
at a time) on a contiguous KV cache. The engine core replaces the loop body with a scheduler, a paged
KV pool and batched forwards; `add_request`, `step`, `abort` and the outputs stay as they are.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engines.attention import AttentionMetadata, TorchAttention
from engines.detokenizer import IncrementalDetokenizer
from engines.kv_cache import SequenceKVCache
from engines.model_loader import load_model
from engines.models.llama import LlamaForCausalLM
from engines.request import EngineRequest, FinishReason, RequestOutput
from engines.sampling import sample
from engines.sequence import Sequence
from engines.tokenizer import Tokenizer


class RequestRejected(ValueError):
    """The request cannot be served as asked (too long, bad token ids); the message says why."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class Engine:
    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer, *, max_model_len: int | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        cfg = model.config
        self.max_model_len = min(cfg.max_position_embeddings, max_model_len or cfg.max_position_embeddings)
        self.dtype = model.embed_tokens.weight.dtype
        self._backend = TorchAttention()
        self._running: dict[str, Sequence] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, dtype: str = "bf16", max_model_len: int | None = None) -> Engine:
        return cls(load_model(model_dir, dtype), Tokenizer(model_dir), max_model_len=max_model_len)

    def check(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        """Raise `RequestRejected` if this prompt and token budget cannot be served."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty")
        if n + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
                code="context_length_exceeded",
            )
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestRejected(f"prompt token ids must lie in [0, {vocab})")

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._running:
            raise RequestRejected(f"request id {request.request_id!r} is already running")
        params = request.params
        self.check(request.prompt_token_ids, params.max_tokens)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        )
        detok = IncrementalDetokenizer(self.tokenizer.backend, params.stop)
        self._running[request.request_id] = Sequence(request, detok, stop_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._running.pop(request_id, None)
        if seq is None:
            return None
        seq.finish_reason = FinishReason.ABORT
        seq.cache = None
        return seq.output([])

    def has_unfinished(self) -> bool:
        return bool(self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs = []
        for seq in list(self._running.values()):
            token = self._forward_and_sample(seq)
            new_ids = seq.append(token, self.max_model_len)
            outputs.append(seq.output(new_ids))
            if seq.finish_reason is not None:
                del self._running[seq.request_id]
                seq.cache = None
        return outputs

    def _forward_and_sample(self, seq: Sequence) -> int:
        cfg = self.model.config
        if seq.cache is None:
            capacity = min(seq.prompt_len + seq.request.params.max_tokens, self.max_model_len)
            seq.cache = SequenceKVCache(
                cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity, self.dtype
            )
        start, end = seq.num_computed, len(seq.token_ids)
        meta = AttentionMetadata.for_sequence(seq.cache, start, end - start)
        hidden = self.model(torch.tensor(seq.token_ids[start:end]), torch.arange(start, end), self._backend, meta)
        seq.num_computed = end
        logits = self.model.compute_logits(hidden[-1:])
        return sample(logits, [seq.sampling])[0]
