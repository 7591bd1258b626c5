"""What crosses the boundary between the gateway and an engine: requests in (with verifier hooks), outputs out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from engines.sampling import SamplingParams

if TYPE_CHECKING:  # xgrammar loads only for requests that use it
    import torch

    from engines.structured import Grammar


class FinishReason(StrEnum):
    STOP = "stop"  # end-of-turn token, stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the caller went away
    ERROR = "error"  # the engine failed while serving it
    PRUNED = "pruned"  # a verifier judged this path bad and ended it (its text is dropped)
    ESCALATE = "escalate"  # a verifier judged the answer inadequate: the caller retries on a larger tier


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its log-probability under the model and the most likely alternatives
    (token id, log-probability), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class GenerationHook(Protocol):
    """Called from the engine's step loop for the sequences of the requests that carry it (the n choices
    of one request share one hook): it sees every output and may end sequences. It runs between steps on
    the engine's thread, so it must be cheap."""

    @property
    def top_logprobs(self) -> int:
        """Alternatives per generated token to put in the outputs' `logprobs` (0: no logprobs at all)."""
        ...

    def observe(self, output: RequestOutput) -> None:
        """One step's output of one of its sequences (the last one has a finish reason)."""

    def decide(self) -> Mapping[str, FinishReason]:
        """Sequences (request ids) to end now, with the reason (STOP, PRUNED or ESCALATE)."""
        ...


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first; equal priorities are served first come, first served
    cache_salt: str = ""  # prefix-cache scope: requests share cached prefixes only with the same salt
    hook: GenerationHook | None = None  # verifiers looking at the generation as it runs
    grammar: Grammar | None = None  # structured output: only tokens that keep it valid are sampled
    # Set: a prefill-only request. The prompt is computed (its full blocks join the prefix cache, so the
    # same prompt run next costs no second prefill) and the request ends with the residual stream of its
    # last token after this many decoder layers (`RequestOutput.hidden`), generating nothing.
    hidden_layer: int | None = None
    adapter: str | None = None  # the LoRA adapter (loaded on the engine) it runs under; None: the base model


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text: str  # new text, safe to show (never half a character or half a stop string)
    prompt_tokens: int
    completion_tokens: int  # generated so far, including a final end-of-turn token
    finish_reason: FinishReason | None = None
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache on admission
    draft_proposed: int = 0  # drafted tokens this request's verifications checked, so far
    draft_accepted: int = 0  # of them, kept
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, when the request's hook asks for them
    hidden: torch.Tensor | None = None  # a prefill-only request's hidden state (float32, (hidden_size,))
    stop_sequence: str | None = None  # the stop string that finished it (in-process tiers; None: another reason)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
