"""`POST /v1/messages`' answers in Anthropic's shapes: the `message`, and the events of a stream.

`Blocks` builds both: text opens a `text` block that deltas grow, a tool call closes it and is a `tool_use` block
(its `input` streamed as one `input_json_delta`); a whole answer is one feed. `stop_reason`: `max_tokens` for a
cut answer, `tool_use` when it called a tool, `stop_sequence` (naming it) when one of the request's ended it,
else `end_turn`. `usage.input_tokens` counts the prompt tokens the prefix cache did not serve, as Anthropic's
does; those it served are `cache_read_input_tokens`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from gateway.api.messages.protocol import AnthropicMessage, MessagesUsage
from gateway.api.serving import cached_tokens, fed
from gateway.http.errors import APIError
from gateway.http.streaming import typed_sse
from gateway.pipeline import Generation
from gateway.tool_calls import CallSpec, ParsedCall, Piece

__all__ = ["Blocks", "anthropic_error", "message_events", "whole"]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def anthropic_error(exc: APIError) -> dict[str, Any]:
    """An error in Anthropic's shape (its `type` by status: 5xx are `api_error`)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}


class Blocks:
    """The message's content blocks as text and calls arrive; each step's events, for a stream."""

    def __init__(self, calls: CallSpec | None) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._parser = calls.parser() if calls is not None else None
        self._open = False  # the last block is a text block still growing

    def feed(self, text: str, last: bool) -> list[dict[str, Any]]:
        piece = Piece(text) if self._parser is None else self._parser.step(text, last)
        events: list[dict[str, Any]] = []
        if piece.content:
            if not self._open:
                self.blocks.append({"type": "text", "text": ""})
                self._open = True
                events.append(self._start({"type": "text", "text": ""}))
            self.blocks[-1]["text"] += piece.content
            events.append(self._delta({"type": "text_delta", "text": piece.content}))
        for call in piece.calls:
            events += self._close() + self._call(call)
        return events + (self._close() if last else [])

    @property
    def called(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def _call(self, call: ParsedCall) -> list[dict[str, Any]]:
        block = {
            "type": "tool_use",
            "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name,
            "input": json.loads(call.arguments),
        }
        self.blocks.append(block)
        return [
            self._start({**block, "input": {}}),
            self._delta({"type": "input_json_delta", "partial_json": call.arguments}),
            {"type": "content_block_stop", "index": len(self.blocks) - 1},
        ]

    def _close(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _start(self, block: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


def _stop(gen: Generation, blocks: Blocks, reason: str | None) -> tuple[str, str | None]:
    if reason == "length":
        return "max_tokens", None
    if blocks.called:
        return "tool_use", None
    sequence = next((o.stop_sequence for o in gen.last_outputs if o is not None), None)
    return ("stop_sequence", sequence) if sequence is not None else ("end_turn", None)


def _usage(gen: Generation) -> MessagesUsage:
    cached = cached_tokens(gen)
    usage = gen.usage
    return MessagesUsage(
        input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens, cache_read_input_tokens=cached
    )


def whole(gen: Generation, text: str, reason: str | None) -> AnthropicMessage:
    blocks = Blocks(gen.plan.calls)
    blocks.feed(text, last=True)
    stop_reason, sequence = _stop(gen, blocks, reason)
    return AnthropicMessage(
        id=gen.request_id,
        model=gen.model,
        content=blocks.blocks,
        stop_reason=stop_reason,
        stop_sequence=sequence,
        usage=_usage(gen),
    )


async def message_events(gen: Generation) -> AsyncIterator[str]:
    """message_start, ping, the blocks' events, message_delta (the stop reason, the usage), message_stop; an error
    after the start is an `error` event."""
    start = AnthropicMessage(id=gen.request_id, model=gen.model, content=[], stop_reason=None, usage=_usage(gen))
    yield typed_sse({"type": "message_start", "message": start.model_dump()})
    yield typed_sse({"type": "ping"})
    blocks, reasons = Blocks(gen.plan.calls), []
    try:
        async for payload in fed(gen, blocks.feed, reasons):
            yield typed_sse(payload)
    except APIError as exc:
        yield typed_sse(anthropic_error(exc))
        return
    reason = reasons[-1] if reasons else None
    stop_reason, sequence = _stop(gen, blocks, reason)
    delta = {"stop_reason": stop_reason, "stop_sequence": sequence}
    yield typed_sse({"type": "message_delta", "delta": delta, "usage": _usage(gen).model_dump()})
    yield typed_sse({"type": "message_stop"})
