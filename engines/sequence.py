"""A request's life inside the engine: its tokens, its KV cache and how far it has been computed."""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.detokenizer import IncrementalDetokenizer
from engines.kv_cache import SequenceKVCache
from engines.request import EngineRequest, FinishReason, RequestOutput
from engines.sampling import SamplingState


@dataclass
class Sequence:
    request: EngineRequest
    detokenizer: IncrementalDetokenizer
    stop_ids: frozenset[int]
    cache: SequenceKVCache | None = None
    sampling: SamplingState = field(init=False)
    token_ids: list[int] = field(init=False)  # prompt + generated
    num_computed: int = 0  # tokens whose keys and values are in the cache
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        self.sampling = SamplingState(self.request.params)
        self.token_ids = list(self.request.prompt_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def append(self, token_id: int, max_model_len: int) -> list[int]:
        """Record a sampled token and decide whether the sequence is done; returns the new ids."""
        self.token_ids.append(token_id)
        self.sampling.output_ids.append(token_id)
        params = self.request.params
        if token_id in self.stop_ids:
            self.finish_reason = FinishReason.STOP  # the end token itself shows no text
        elif self.detokenizer.push(token_id):
            self.finish_reason = FinishReason.STOP
        elif self.num_generated >= params.max_tokens or len(self.token_ids) >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
        return [token_id]

    def output(self, new_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_ids,
            text=self.detokenizer.take(finished=self.finish_reason is not None),
            prompt_tokens=self.prompt_len,
            completion_tokens=self.num_generated,
            finish_reason=self.finish_reason,
        )
