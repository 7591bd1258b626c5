"""`POST /v1/completions`' answers in OpenAI's shapes: a `Completion` (logprobs where asked), and the
`text_completion` events of a stream (the usage chunk where `stream_options.include_usage`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.api.logprobs import completion_logprobs
from gateway.api.serving import asked_logprobs, stream
from gateway.http.schemas import Completion, CompletionChoice, chunk_json
from gateway.http.streaming import sse
from gateway.pipeline import ChoiceDelta, Generation

__all__ = ["completion_events", "completion_result"]


def completion_result(gen: Generation, texts: list[str], reasons: list[str | None]) -> Completion:
    """The whole answer, as a `Completion`."""
    k = asked_logprobs(gen)
    choices = [
        CompletionChoice(index=i, text=t, finish_reason=r,
                         logprobs=None if k is None else completion_logprobs(gen.logprobs[i], gen.tokenizer, k))
        for i, (t, r) in enumerate(zip(texts, reasons, strict=True))
    ]  # fmt: skip
    return Completion(id=gen.request_id, created=gen.created, model=gen.model, choices=choices, usage=gen.usage)


async def completion_events(gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[CompletionChoice], usage: bool = False) -> str:
        c = Completion(
            id=gen.request_id, created=gen.created, model=gen.model, choices=choices, usage=gen.usage if usage else None
        )
        return sse(chunk_json(c, include_usage))

    k, offsets = asked_logprobs(gen), [0] * gen.num_choices

    def delta_chunks(d: ChoiceDelta) -> list[str]:
        logprobs = None
        if k is not None:
            logprobs = completion_logprobs(d.logprobs, gen.tokenizer, k, offsets[d.index])
            offsets[d.index] += sum(len(t) for t in logprobs.tokens)
        return [chunk([CompletionChoice(index=d.index, text=d.text, finish_reason=d.finish_reason, logprobs=logprobs)])]

    async for payload in stream(gen, delta_chunks, (lambda: chunk([], usage=True)) if include_usage else None):
        yield payload
