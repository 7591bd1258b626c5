"""Pydantic models of the OpenAI-compatible API: what clients send and what we answer.

Requests accept and ignore fields we do not know (as vLLM does) but reject, with a 400 naming the
field, features we know and do not serve yet, rather than silently answering something else. Known
fields are strict: a number for a string, or a string or boolean for a number, is a 422 naming the
field, as the OpenAPI document says, rather than a guess at what the client meant.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, computed_field, model_validator

from gateway.http.json_schema import bounded_schema

# Fields clients may send that we do not serve yet; setting one to a non-default value is a 400.
UNSUPPORTED_CHAT = (
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
)
UNSUPPORTED_COMPLETION = ("echo", "suffix", "best_of")


def _unicode(text: str) -> str:
    """JSON can escape a lone surrogate (`\\ud800`), which no tokenizer or UTF-8 store accepts: refuse it here."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it holds a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
Stop = Text | Annotated[list[Text], Field(max_length=16)] | None

# The sampler divides logits by the temperature and cuts top-p mass in float32, where a value this
# small under- or overflows (5e-324 is 0 in float32); the answer below it is the greedy one anyway.
TINY = 1e-6
Temperature = Annotated[float, Field(ge=0.0, le=2.0), AfterValidator(lambda t: 0.0 if t < TINY else t)]
TopP = Annotated[float, Field(gt=0.0, le=1.0), AfterValidator(lambda p: max(p, TINY))]
INT32_MAX = 2**31 - 1  # token counts are stored in 32-bit columns
SEED = 2**63  # torch seeds its generators from 64 bits
MAX_LOGIT_BIAS = 300  # OpenAI's limit on `logit_bias` entries
MAX_TOOLS = 128  # tools per request, and calls per assistant turn (OpenAI's limit on tools)
MAX_TOOL_NAME = 64  # OpenAI's limit on a function's name
# Messages or prompts per request, at most: every one is templated and tokenized before the context
# check can refuse them, so 100k empty ones would cost seconds of CPU on the event loop.
MAX_ITEMS = 2048


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Text = Field(min_length=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = Field(None, ge=0, description="extension: keep only the k most likely tokens")
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: int | None = Field(None, ge=-SEED, lt=SEED - 64)  # room for one seed per choice
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    user: Text | None = None
    # token id (as a string, JSON's keys) → added to its logit, -100 (ban) to 100 (force)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)

    def unsupported(self, names: tuple[str, ...]) -> str | None:
        extra = self.model_extra or {}
        return next((n for n in names if extra.get(n) not in (None, False, [], {})), None)

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    """A call as OpenAI writes it: the arguments are a JSON string."""

    model_config = ConfigDict(strict=True)

    name: Text = Field(min_length=1, max_length=MAX_TOOL_NAME)
    arguments: Text


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True)

    id: Text = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # an assistant turn's calls
    tool_call_id: Text | None = None  # a `tool` turn: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


Schema = Annotated[dict[str, Any], AfterValidator(bounded_schema)]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: Annotated[Text, Field(min_length=1, max_length=MAX_TOOL_NAME, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: Text | None = None
    parameters: Schema | None = None  # a JSON schema; none: any JSON object
    strict: bool | None = None  # always strict here: calls are constrained to the schema


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)

    name: Text = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: NamedFunction


MAX_SCHEMA_CHARS = 65_536  # a response schema's JSON, at most: it is compiled while the client waits


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    name: Text = Field("response", min_length=1, max_length=64)
    description: Text | None = None
    schema_: Schema = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # always strict here: the output is constrained to the schema


class ResponseFormat(BaseModel):
    """OpenAI's `text`, `json_object` and `json_schema`, plus `regex` (an extension: `{"type": "regex",
    "regex": "..."}`, the whole answer matches it)."""

    model_config = ConfigDict(strict=True)

    type: Literal["text", "json_object", "json_schema", "regex"]
    json_schema: JsonSchemaFormat | None = None
    regex: Text | None = Field(None, min_length=1, max_length=4096)

    @model_validator(mode="after")
    def _complete(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("`json_schema` is required when type is json_schema")
        if self.type == "regex" and self.regex is None:
            raise ValueError("`regex` is required when type is regex")
        return self


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_ITEMS)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None  # each generated token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=20)  # and this many alternatives (needs `logprobs`)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # default: true, as OpenAI's


Prompt = (
    Annotated[Text, Field(min_length=1)]
    | Annotated[list[Text], Field(min_length=1, max_length=MAX_ITEMS)]
    | Annotated[list[int], Field(min_length=1)]
    | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_ITEMS)]
)


class CompletionRequest(_Request):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=5)  # each token's log-probability and this many alternatives


EmbeddingInput = (
    Annotated[Text, Field(min_length=1)]
    | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1, max_length=MAX_ITEMS)]
    | Annotated[list[int], Field(min_length=1)]
    | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_ITEMS)]
)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Text = Field(min_length=1)
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=65536)
    user: Text | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 values' little-endian bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a streamed call: the first carries its id, type and name, later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


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
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """OpenAI's model card and Anthropic's `ModelInfo` in one (each client reads its own fields)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "switchboard"
    type: Literal["model"] = "model"

    @computed_field  # type: ignore[prop-decorator]
    @property
    def display_name(self) -> str:
        return self.id

    @computed_field  # type: ignore[prop-decorator]
    @property
    def created_at(self) -> str:
        return datetime.fromtimestamp(self.created, UTC).isoformat().replace("+00:00", "Z")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False  # Anthropic's paging: everything is on one page

    @computed_field  # type: ignore[prop-decorator]
    @property
    def first_id(self) -> str | None:
        return self.data[0].id if self.data else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def last_id(self) -> str | None:
        return self.data[-1].id if self.data else None


def chunk_json(chunk: BaseModel, include_usage: bool) -> str:
    """One SSE payload; `usage: null` appears on every chunk only when the client asked for usage."""
    return chunk.model_dump_json(exclude=None if include_usage else {"usage"})
