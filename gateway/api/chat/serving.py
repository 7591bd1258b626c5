"""`POST /v1/chat/completions`' answers in OpenAI's shapes: a `ChatCompletion` (each choice's text read for tool
calls where the request has tools, logprobs where asked), and the `chat.completion.chunk` events of a stream
(the role first, content deltas, tool calls as their id and name then their arguments, the finish reason,
the usage chunk where `stream_options.include_usage`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.api.logprobs import chat_logprobs
from gateway.api.serving import asked_logprobs, stream
from gateway.http.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
    ToolCall,
    ToolCallDelta,
    chunk_json,
)
from gateway.http.streaming import sse
from gateway.pipeline import ChoiceDelta, Generation
from gateway.tool_calls import CallParser, CallSpec, ParsedCall, parse_answer

__all__ = ["chat_events", "chat_result"]


def chat_result(gen: Generation, texts: list[str], reasons: list[str | None]) -> ChatCompletion:
    """The whole answer, as a `ChatCompletion`."""
    choices = [_chat_choice(i, t, r, gen.plan.calls) for i, (t, r) in enumerate(zip(texts, reasons, strict=True))]
    if (k := asked_logprobs(gen)) is not None:
        for choice, tokens in zip(choices, gen.logprobs, strict=True):
            choice.logprobs = chat_logprobs(tokens, gen.tokenizer, k)
    return ChatCompletion(id=gen.request_id, created=gen.created, model=gen.model, choices=choices, usage=gen.usage)


def _chat_choice(index: int, text: str, reason: str | None, calls: CallSpec | None) -> ChatChoice:
    """One choice; with tools, its text read for calls (`gateway.tool_calls`)."""
    if calls is None:
        return ChatChoice(index=index, message=ChatMessageOut(content=text), finish_reason=reason)
    content, parsed = parse_answer(text, calls)
    message = ChatMessageOut(content=content, tool_calls=[_tool_call(c) for c in parsed] or None)
    return ChatChoice(index=index, message=message, finish_reason=_reason(reason, bool(parsed)))


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall.model_validate({"id": call.id, "function": {"name": call.name, "arguments": call.arguments}})


def _reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's `tool_calls` for an answer that ended by itself with calls; a cut one stays `length`."""
    return "tool_calls" if called and reason == "stop" else reason


async def chat_events(gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: bool = False) -> str:
        c = ChatCompletionChunk(
            id=gen.request_id, created=gen.created, model=gen.model, choices=choices, usage=gen.usage if usage else None
        )
        return sse(chunk_json(c, include_usage))

    parsers: dict[int, CallParser] = {}
    spec, k = gen.plan.calls, asked_logprobs(gen)

    def delta_chunks(d: ChoiceDelta) -> list[str]:
        choices = tool_choices(d) if spec is not None else plain_choices(d)
        if k is not None and d.logprobs:  # the delta's tokens ride on its first chunk, or on one of their own
            if not choices:
                choices = [ChatChunkChoice(index=d.index, delta=ChatDelta())]
            choices[0].logprobs = chat_logprobs(d.logprobs, gen.tokenizer, k)
        return [chunk([c]) for c in choices]

    def tool_choices(d: ChoiceDelta) -> list[ChatChunkChoice]:
        assert spec is not None
        parser = parsers.setdefault(d.index, spec.parser())
        before = len(parser.calls)
        piece = parser.step(d.text, last=bool(d.finish_reason))
        out = [ChatChunkChoice(index=d.index, delta=ChatDelta(content=piece.content))] if piece.content else []
        for n, call in enumerate(piece.calls, start=before):  # the id and name first, then the arguments
            first = ToolCallDelta.model_validate({"index": n, "id": call.id, "type": "function",
                                                  "function": {"name": call.name, "arguments": ""}})  # fmt: skip
            rest = ToolCallDelta.model_validate({"index": n, "function": {"arguments": call.arguments}})
            out += [ChatChunkChoice(index=d.index, delta=ChatDelta(tool_calls=[delta])) for delta in (first, rest)]
        if d.finish_reason:
            reason = _reason(d.finish_reason, bool(parser.calls))
            out.append(ChatChunkChoice(index=d.index, delta=ChatDelta(), finish_reason=reason))
        return out

    def plain_choices(d: ChoiceDelta) -> list[ChatChunkChoice]:
        out = []
        if d.text:
            out.append(ChatChunkChoice(index=d.index, delta=ChatDelta(content=d.text)))
        if d.finish_reason:
            out.append(ChatChunkChoice(index=d.index, delta=ChatDelta(), finish_reason=d.finish_reason))
        return out

    for i in range(gen.num_choices):
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    async for payload in stream(gen, delta_chunks, (lambda: chunk([], usage=True)) if include_usage else None):
        yield payload
