"""Pydantic models of the OpenAI-compatible API: what clients send and what we answer.

Requests accept and ignore fields we do not know (as vLLM does) but reject, with a 400 naming the
field, features we know and do not serve yet, rather than silently answering something else.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# Fields clients may send that we do not serve yet; setting one to a non-default value is a 400.
UNSUPPORTED_CHAT = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "audio",
    "modalities",
    "prediction",
)
UNSUPPORTED_COMPLETION = ("logit_bias", "logprobs", "echo", "suffix", "best_of")

Stop = str | Annotated[list[str], Field(max_length=16)] | None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="extension: keep only the k most likely tokens")
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)
    user: str | None = None

    def unsupported(self, names: tuple[str, ...]) -> str | None:
        extra = self.model_extra or {}
        return next((n for n in names if extra.get(n) not in (None, False, [], {})), None)

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "switchboard"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def chunk_json(chunk: BaseModel, include_usage: bool) -> str:
    """One SSE payload; `usage: null` appears on every chunk only when the client asked for usage."""
    return chunk.model_dump_json(exclude=None if include_usage else {"usage"})
