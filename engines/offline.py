"""Offline batch generation: many requests through one engine, up to `slots` sequences at once, topped up
as they finish so the batch stays full. For labeling, benchmarks and training data, not for serving."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from engines.engine import Engine
from engines.request import EngineRequest, FinishReason


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason


def complete_all(engine: Engine, requests: Iterable[EngineRequest], slots: int = 64) -> Iterator[Completion]:
    """Each request's completion as it finishes (not in request order). `requests` is read lazily, so a
    generator can make requests as earlier ones finish."""
    pending = iter(requests)
    running: dict[str, tuple[int, list[str]]] = {}  # request id → (prompt tokens, text pieces)
    exhausted = False
    while True:
        while not exhausted and len(running) < slots:
            request = next(pending, None)
            if request is None:
                exhausted = True
                break
            running[request.request_id] = (len(request.prompt_token_ids), [])
            engine.add_request(request)
        if not running:
            return
        for out in engine.step():
            prompt_tokens, pieces = running[out.request_id]
            pieces.append(out.text)
            if out.finish_reason is not None:
                del running[out.request_id]
                text = "".join(pieces)
                yield Completion(out.request_id, text, prompt_tokens, out.completion_tokens, out.finish_reason)
