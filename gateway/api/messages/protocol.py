"""Anthropic's Messages API as pydantic models: the request (`POST /v1/messages`, `/v1/messages/count_tokens`)
and the `message` it answers with.

`messages` and `tools` are kept as JSON and read block by block in `translate`, so an unsupported block or tool
type is a 400 naming where it is (`messages[2].content[0].type`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.http.schemas import INT32_MAX, MAX_ITEMS, MAX_TOOLS, Stop, Temperature, Text, TopP

__all__ = ["AnthropicError", "AnthropicMessage", "CountTokensRequest", "MessagesRequest", "MessagesUsage"]


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    user_id: Text | None = Field(None, max_length=256)


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Text = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_ITEMS)
    system: Text | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = Field(None, description="accepted and ignored: the tiers' models do not think")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT32_MAX, description="required, as Anthropic's")
    stop_sequences: Stop = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False


class MessagesUsage(BaseModel):
    input_tokens: int = Field(description="prompt tokens not read from the prefix cache")
    output_tokens: int
    cache_read_input_tokens: int = Field(0, description="prompt tokens the engine's prefix cache served")
    cache_creation_input_tokens: int = 0


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessagesUsage


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, not_found_error, "
                      "request_too_large, rate_limit_error or api_error")  # fmt: skip
    message: str


class AnthropicError(BaseModel):
    """What every error under /v1/messages carries, as Anthropic's API answers it."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
