"""OpenAI's Responses API as pydantic models: the request (`POST /v1/responses`) and the `response` object.

The request's `input` and `tools` are kept as JSON here and read item by item in `translate`, so an unknown item
or tool type is a 400 that names it (and where it is), not a wall of union-member errors. Fields a model that
does not reason has no use for (`reasoning`, `service_tier`, `include`, `truncation`) are accepted; what they do
is in docs/api.md.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.http.schemas import INT32_MAX, MAX_ITEMS, MAX_TOOLS, Schema, Temperature, Text, TopP

__all__ = [
    "FunctionCallItem",
    "InputTokensDetails",
    "MessageItem",
    "OutputText",
    "OutputTokensDetails",
    "ResponseObject",
    "ResponseUsage",
    "ResponsesRequest",
    "TextConfig",
]


class TextFormat(BaseModel):
    """`text.format`: `text`, `json_object`, or `json_schema` with its `name`, `schema` and `strict`."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Text | None = Field(None, min_length=1, max_length=64)
    description: Text | None = None
    schema_: Schema | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Text = Field(min_length=1)
    input: Text | list[dict[str, Any]] = Field(description="a string (one user message) or a list of input items")
    instructions: Text | None = Field(None, description="a system message for this turn only (not carried on)")
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS, description="`function` tools")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: dict[str, Text] | None = Field(None, max_length=16)
    user: Text | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Text] | None = None
    reasoning: dict[str, Any] | None = Field(None, description="accepted; the tiers' models do not reason")
    service_tier: Text | None = Field(None, description="accepted and echoed; every request is served alike")
    stream: bool = False
    store: bool = Field(True, description="keep the response and its input for `previous_response_id` and GET")
    previous_response_id: Text | None = Field(None, min_length=1, max_length=128)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens the engine's prefix cache served")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[MessageItem | FunctionCallItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    service_tier: str | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


MAX_INPUT_ITEMS = MAX_ITEMS  # as chat's messages: every one is templated before the context check refuses them
