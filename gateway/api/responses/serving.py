"""`POST /v1/responses`' answers in OpenAI's shapes: the `response` object, and the typed events of a stream.

One `Output` builds both: text opens a `message` item (its `output_text` part grows by deltas), a tool call
closes it and becomes a `function_call` item; a whole answer is one feed, a stream one feed per delta, so a
stream's items are the non-streamed ones (text a model writes between two calls is a message item of its own
in a stream, and joins the first in a whole answer). Every event carries its `sequence_number`; an error after
the stream started is `response.failed` with the error, and what ran is still billed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway.api.logprobs import chat_logprobs
from gateway.api.responses.protocol import ResponseObject, ResponsesRequest, ResponseUsage
from gateway.api.responses.translate import item_id
from gateway.api.serving import asked_logprobs, cached_tokens, fed
from gateway.http.errors import APIError
from gateway.http.streaming import typed_sse
from gateway.pipeline import Generation
from gateway.tool_calls import CallSpec, ParsedCall, Piece

__all__ = ["Keep", "Output", "response_events", "response_object", "whole"]

Keep = Callable[[ResponseObject], Awaitable[None]]  # stores a finished response (`store: true`)


class Output:
    """The response's output items as text and calls arrive; each step's events, for a stream."""

    def __init__(self, calls: CallSpec | None) -> None:
        self.items: list[dict[str, Any]] = []
        self._parser = calls.parser() if calls is not None else None
        self._message: dict[str, Any] | None = None  # the open message item

    def feed(self, text: str, last: bool) -> list[dict[str, Any]]:
        piece = Piece(text) if self._parser is None else self._parser.step(text, last)
        events = self._text(piece.content) if piece.content else []
        for call in piece.calls:
            events += self._close() + self._call(call)
        return events + (self._close() if last else [])

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            self._message = {
                "type": "message",
                "id": item_id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.items.append(self._message)
            at = self._at()
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": at["output_index"],
                    "item": _copy(self._message),
                },
                {"type": "response.content_part.added", **at, "part": _part("")},
            ]
            self._message["content"].append(_part(""))
        self._message["content"][0]["text"] += text
        return [*events, {"type": "response.output_text.delta", **self._at(), "delta": text, "logprobs": []}]

    def _close(self) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        message, at = self._message, self._at()
        self._message = None
        message["status"] = "completed"
        text = message["content"][0]["text"]
        return [
            {"type": "response.output_text.done", **at, "text": text, "logprobs": []},
            {"type": "response.content_part.done", **at, "part": _part(text)},
            {"type": "response.output_item.done", "output_index": at["output_index"], "item": _copy(message)},
        ]

    def _call(self, call: ParsedCall) -> list[dict[str, Any]]:
        item = {
            "type": "function_call",
            "id": "fc_" + call.id.removeprefix("call_"),
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
        self.items.append(item)
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        return [
            {
                "type": "response.output_item.added",
                "output_index": at["output_index"],
                "item": {**item, "arguments": "", "status": "in_progress"},
            },
            {"type": "response.function_call_arguments.delta", **at, "delta": call.arguments},
            {"type": "response.function_call_arguments.done", **at, "name": call.name, "arguments": call.arguments},
            {"type": "response.output_item.done", "output_index": at["output_index"], "item": dict(item)},
        ]

    def _at(self) -> dict[str, Any]:
        assert self._message is not None
        return {"item_id": self._message["id"], "output_index": self.items.index(self._message), "content_index": 0}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


def response_object(body: ResponsesRequest, gen: Generation, items: list[dict], reason: str | None) -> ResponseObject:
    """The response as OpenAI writes it: the request's settings echoed, the output, the status and the usage."""
    usage = gen.usage
    cut = reason == "length"
    sent = body.model_dump(exclude_none=True)
    echoed = {
        k: sent[k]
        for k in (
            "instructions",
            "max_output_tokens",
            "temperature",
            "top_p",
            "top_logprobs",
            "previous_response_id",
            "service_tier",
            "user",
            "metadata",
            "truncation",
            "reasoning",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
        )
        if k in sent
    }
    if body.text is not None:
        echoed["text"] = {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
    return ResponseObject.model_validate(
        {
            **echoed,
            "id": gen.request_id,
            "created_at": gen.created,
            "model": gen.model,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": items,
            "store": body.store,
            "usage": ResponseUsage.model_validate(
                {
                    "input_tokens": usage.prompt_tokens,
                    "input_tokens_details": {"cached_tokens": cached_tokens(gen)},
                    "output_tokens": usage.completion_tokens,
                    "total_tokens": usage.total_tokens,
                }
            ),
        }
    )


def whole(body: ResponsesRequest, gen: Generation, text: str, reason: str | None) -> ResponseObject:
    """A non-streamed answer's response (the logprobs on its first text part, where `include` asked)."""
    output = Output(gen.plan.calls)
    output.feed(text, last=True)
    if (k := asked_logprobs(gen)) is not None:
        messages = [i for i in output.items if i["type"] == "message"]
        if messages:
            logprobs = chat_logprobs(gen.logprobs[0], gen.tokenizer, k).content or []
            messages[0]["content"][0]["logprobs"] = [t.model_dump() for t in logprobs]
    return response_object(body, gen, output.items, reason)


async def response_events(body: ResponsesRequest, gen: Generation, keep: Keep | None) -> AsyncIterator[str]:
    """The stream: created, in progress, the items' events, then completed (or incomplete, or failed)."""
    seq = 0

    def event(payload: dict[str, Any]) -> str:
        nonlocal seq
        payload["sequence_number"], seq = seq, seq + 1
        return typed_sse(payload)

    start = response_object(body, gen, [], None).model_copy(update={"status": "in_progress", "usage": None})
    yield event({"type": "response.created", "response": start.model_dump()})
    yield event({"type": "response.in_progress", "response": start.model_dump()})
    output, reasons = Output(gen.plan.calls), []
    try:
        async for payload in fed(gen, output.feed, reasons):
            yield event(payload)
    except APIError as exc:
        failed = start.model_copy(
            update={"status": "failed", "error": {"code": exc.code or "server_error", "message": exc.message}}
        )
        yield event({"type": "response.failed", "response": failed.model_dump()})
        return
    reason = reasons[-1] if reasons else None
    final = response_object(body, gen, output.items, reason)
    if keep is not None:
        await keep(final)
    kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
    yield event({"type": kind, "response": final.model_dump()})
