"""A request's life inside the engine: its tokens, its blocks and how far it has been computed.

vLLM's rule with no phases: `token_ids` is the target, `num_computed` how many of them have keys and
values in the KV cache. A step computes some of the rest; a sequence whose whole target is computed
samples its next token. Prefill, chunked prefill, prefix hits and decode are all this one rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

from engines.block_manager import BlockTable
from engines.detokenizer import IncrementalDetokenizer
from engines.request import EngineRequest, FinishReason, RequestOutput, TokenLogprob
from engines.sampling import SamplingState

if TYPE_CHECKING:
    from engines.structured import Constraint


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class Sequence:
    request: EngineRequest
    detokenizer: IncrementalDetokenizer
    stop_ids: frozenset[int]
    block_table: BlockTable
    arrival: int  # admission order to the engine: FCFS ties and preemption pick from it
    sampling: SamplingState = field(init=False)
    token_ids: list[int] = field(init=False)  # prompt + generated
    num_computed: int = 0  # tokens whose keys and values are in the cache
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    cached_tokens: int = -1  # prompt tokens the prefix cache covered on first admission (-1: not yet)
    draft_proposed: int = 0
    draft_accepted: int = 0
    constraint: Constraint | None = field(init=False, default=None)  # its grammar, if it has one

    def __post_init__(self) -> None:
        self.sampling = SamplingState(self.request.params)
        self.token_ids = list(self.request.prompt_token_ids)
        grammar = self.request.grammar
        self.constraint = grammar.constraint() if grammar is not None else None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def append(self, token_id: int, max_model_len: int) -> None:
        """Record a sampled token and decide whether the sequence is done."""
        self.token_ids.append(token_id)
        self.sampling.output_ids.append(token_id)
        if self.constraint is not None:
            self.constraint.accept(token_id)
        params = self.request.params
        if token_id in self.stop_ids:
            self.finish_reason = FinishReason.STOP  # the end token itself shows no text
        elif self.detokenizer.push(token_id):
            self.finish_reason = FinishReason.STOP
        elif self.num_generated >= params.max_tokens or len(self.token_ids) >= max_model_len:
            self.finish_reason = FinishReason.LENGTH

    def output(self, new_ids: list[int], logprobs: tuple[TokenLogprob, ...] = ()) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_ids,
            text=self.detokenizer.take(finished=self.finish_reason is not None),
            prompt_tokens=self.prompt_len,
            completion_tokens=self.num_generated,
            finish_reason=self.finish_reason,
            cached_tokens=max(0, self.cached_tokens),
            stop_sequence=self.detokenizer.stopped_by,
            draft_proposed=self.draft_proposed,
            draft_accepted=self.draft_accepted,
            logprobs=logprobs,
        )
