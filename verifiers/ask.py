"""`Ask` for final checks: a tier's engine asked a question of the check's own, from the check's thread.

Final checks run on a worker thread (`VerifierHook.run_checks`), while a tier's engine streams to the
event loop; `tier_ask` hops back to that loop for the generation (`anyio.from_thread`, or a blocking
portal a caller without one starts: benchmarks), and blocks the checking thread until the reply is in.
The question goes to the same engine as the answer, greedily unless asked otherwise, with the request's
prefix-cache salt; a reply that cannot be had (too long, the tier down or failing) raises `AskFailed`.
`spent` hears the tokens of each question asked (prompt, completion): a check's own cost.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence

import anyio.from_thread

from engines.protocol import EngineUnavailable, RequestRejected, TierEngine
from engines.request import EngineRequest, FinishReason
from engines.sampling import SamplingParams
from verifiers.base import Ask, AskFailed


def tier_ask(
    engine: TierEngine,
    *,
    salt: str = "",
    portal: anyio.from_thread.BlockingPortal | None = None,
    spent: Callable[[int, int], None] | None = None,
) -> Ask:
    """An `Ask` on `engine`, called from a worker thread of the event loop the engine streams to (or any
    thread, given that loop's `portal`)."""

    async def generate(request: EngineRequest) -> str:
        try:
            stream = engine.open([request])
        except EngineUnavailable as exc:
            raise AskFailed(str(exc)) from None
        pieces, completion = [], 0
        try:
            async for out in stream:
                if out.finish_reason is FinishReason.ERROR:
                    raise AskFailed(out.error or "the engine failed")
                pieces.append(out.text)
                completion = out.completion_tokens
        except EngineUnavailable as exc:
            raise AskFailed(str(exc)) from None
        finally:
            await stream.aclose()
        if spent is not None:
            spent(len(request.prompt_token_ids), completion)
        return "".join(pieces)

    def ask(messages: Sequence[Mapping[str, str]], max_tokens: int, temperature: float = 0.0) -> str:
        try:
            prompt = engine.tokenizer.encode_chat([dict(m) for m in messages])  # here: tokenizing is work
        except ValueError as exc:  # the chat template refused (or there is none)
            raise AskFailed(str(exc)) from None
        budget = min(max_tokens, engine.max_model_len - len(prompt))
        try:
            engine.check(prompt, max(budget, 1))
        except RequestRejected as exc:
            raise AskFailed(str(exc)) from None
        params = SamplingParams(max_tokens=max(budget, 1), temperature=temperature)
        request = EngineRequest(f"check-{uuid.uuid4().hex}", prompt, params, cache_salt=salt)
        if portal is not None:
            return portal.call(generate, request)
        return anyio.from_thread.run(generate, request)

    return ask
