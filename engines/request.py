"""What crosses the boundary between the gateway and an engine: requests in, outputs out."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from engines.sampling import SamplingParams


class FinishReason(StrEnum):
    STOP = "stop"  # end-of-turn token, stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the caller went away
    ERROR = "error"  # the engine failed while serving it


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first; equal priorities are served first come, first served
    cache_salt: str = ""  # prefix-cache scope: requests share cached prefixes only with the same salt


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
