"""A run: a `Plan` → the engine stream (or the replay of a cached answer) → choice deltas → an `Outcome`.

    begin     the first candidate tier that can take the requests takes them (a tier that is down, or
              fails before any output, passes them on to the next)
    events()  the deltas, as the engine produces them; however the stream ends (finished, client gone,
              engine error) the stream is closed, the final checks run on a finished answer, and what ran
              is metered, exactly once (`gateway.pipeline.metering`)
    then      an answer whose stream ran to its end is stored in the response cache, if it may be
              (`cache_store`); once the response is out, the routing stage's follow-ups run
              (`after_response`)

Single flight (`single_flight`): a leader publishes its deltas and, once billed, its answer (or its
release) to the requests waiting for it; a streamed follower streams the leader's deltas instead of running,
and runs on its own only if the leader is released.

The plan never changes; what changes while the request runs is in `_RunState`. (A streamed follower's
generation swaps its plan once for the plan of what it turned out to be: a hit, or a miss run on its own.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import anyio

from engines.protocol import EngineUnavailable, OutputStream, RequestRejected
from engines.request import FinishReason, RequestOutput, TokenLogprob
from engines.tokenizer import Tokenizer
from gateway.cache.exact import CachedAnswer
from gateway.cache.stage import CacheStage
from gateway.http.errors import APIError, invalid
from gateway.http.schemas import Usage
from gateway.pipeline import cache_store, cascade
from gateway.pipeline.choices import Candidate, ChoiceDelta
from gateway.pipeline.followups import after_response
from gateway.pipeline.metering import Meter
from gateway.pipeline.plan import Outcome, Plan
from gateway.pipeline.refusals import unavailable
from gateway.pipeline.single_flight import Flight, Forwarded
from gateway.pipeline.streams import Primed, Watch, failed_before_output, replay_pieces
from gateway.pipeline.wires import prompt_field
from gateway.routing.stage import RoutingStage
from verifiers.ask import tier_ask


@dataclass
class _RunState:
    """What changes while a request runs."""

    serving: Candidate  # the tier that serves: the plan's, or the fallback that took the requests
    status: str = "pending"  # → running → ok | aborted | error | escalated; or abandoned: it never ran
    stream: OutputStream | None = None  # once a tier took the requests
    started: float | None = None  # a tier was first asked (or the replay began): latency counts from here
    texts: list[str] = field(default_factory=list)  # each choice's text so far, once it runs on a tier
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)  # each choice's tokens', when asked for
    reasons: list[str | None] = field(default_factory=list)  # each choice's finish reason so far
    completion_tokens: int = 0
    ttft: float | None = None  # seconds from start to the first generated text (engine runs only)
    settled: bool = False  # metered, or its reservation given back
    outcome: Outcome | None = None  # once metered
    followed_up: bool = False  # after_response ran
    check_tokens: tuple[int, int] = (0, 0)  # what final checks asked the serving tier for (billed)


class Generation:
    """A planned request: iterate `events()` (or `collect()`) to run it, once."""

    def __init__(self, plan: Plan, meter: Meter, cache: CacheStage | None, routing: RoutingStage) -> None:
        self.plan = plan
        self._meter = meter
        self._cache = cache
        self._routing = routing
        self._state = _RunState(serving=plan.serving)
        self._index = {r.request_id: i for i, r in enumerate(plan.work.requests)}  # choice of each engine request

    # --- what the API shows ---------------------------------------------------------------------------

    @property
    def request_id(self) -> str:
        return self.plan.caller.request_id

    @property
    def created(self) -> int:
        return self.plan.caller.created

    @property
    def model(self) -> str:
        return self.plan.caller.model

    @property
    def num_choices(self) -> int:
        return self.plan.work.num_choices

    @property
    def tier(self) -> str:
        """The tier that serves (a fallback when the requested one is down)."""
        return self._state.serving.name

    @property
    def tokenizer(self) -> Tokenizer:
        """The serving tier's tokenizer: what its token ids (logprobs) mean."""
        return self._state.serving.engine.tokenizer

    @property
    def logprobs(self) -> list[list[TokenLogprob]]:
        """Each choice's generated tokens with their log-probabilities (empty unless the request asked)."""
        return self._state.logprobs or [[] for _ in range(self.num_choices)]

    @property
    def usage(self) -> Usage:
        prompt, completion = self.plan.work.prompt_tokens, self._state.completion_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    @property
    def last_outputs(self) -> list[RequestOutput | None]:
        """Each choice's last engine output: its cached prompt tokens, its stop string (None: a cached answer)."""
        last = self._state.stream.last if self._state.stream else {}
        return [last.get(r.request_id) for r in self.plan.work.requests]

    @property
    def verifier_actions(self) -> list[dict[str, Any]]:
        return self.plan.verifier_actions

    @property
    def escalation(self) -> str | None:
        """Set once the answer failed a final check: the tier the cascade retries it on."""
        return self.plan.checks.cascade_to if self._state.status == "escalated" else None

    @property
    def outcome(self) -> Outcome | None:
        return self._state.outcome

    # --- running --------------------------------------------------------------------------------------

    async def begin(self) -> OutputStream:
        """Have the first candidate tier that can take the requests take them, and wait for its first output.

        A tier that is down, or fails before any output (a remote after its retries), passes the requests
        on to the next candidate. Streaming responses call this before their headers go out, so that
        `x-switchboard-tier` names the tier that serves and a refusal is still an HTTP error.
        """
        s = self._state
        if s.stream is not None:
            return s.stream
        s.started = time.perf_counter()
        candidates = self.plan.work.candidates
        for i, candidate in enumerate(candidates):
            try:
                stream = candidate.engine.open(list(self.plan.work.requests))
            except EngineUnavailable:  # stopped since admission: nothing ran here
                continue
            # Set before waiting: a client leaving meanwhile is billed for what ran, on this tier.
            s.stream, s.serving = stream, candidate
            try:
                first = await anext(stream)
            except EngineUnavailable:
                first = None
            except RequestRejected as exc:  # a remote judged the request itself: the client's to fix
                await self._drop_stream()
                await self._release()
                raise invalid(str(exc), param=prompt_field(self.plan.caller.endpoint), code=exc.code) from None
            last = i == len(candidates) - 1
            if first is not None and not (failed_before_output(first) and not last):
                s.stream = Primed(stream, first)
                if (lead := self.plan.lead) is not None:
                    if candidate.name == self.plan.wanted_tier:
                        lead.start(candidate)
                    else:  # a fallback's answer is not the one its followers would get from the cache
                        lead.release()
                return s.stream
            await self._drop_stream()
        await self._release()
        raise unavailable(self.plan.caller.model)

    async def begin_stream(self, watch: Watch) -> None:
        """For a streamed response, before its headers go out: `begin` (a cached answer needs no tier). If
        that fails or the client leaves, what ran is billed or the reservation given back."""
        try:
            if (follow := self.plan.follow) is not None:  # the leader's tier serves it (single flight)
                self._state.serving = follow.serving or self._state.serving
            elif self.plan.cache.answer is None:
                await watch(self.begin())
        except BaseException:
            await self.abandon()
            raise

    async def events(self) -> AsyncIterator[ChoiceDelta]:
        s = self._state
        if s.status != "pending":
            raise RuntimeError("a generation runs once")
        s.status = "running"
        if (answer := self.plan.cache.answer) is not None:
            async for delta in self._replay(answer):
                yield delta
            return
        source = self._generate() if self.plan.follow is None else self._follow(self.plan.follow)
        async with aclosing(source) as deltas:
            async for delta in deltas:
                yield delta

    async def _generate(self) -> AsyncIterator[ChoiceDelta]:
        """Run on the engines; a leader's followers see each delta as it comes."""
        s, lead = self._state, self.plan.lead
        n = self.plan.work.num_choices
        s.texts, s.reasons, s.logprobs = [""] * n, [None] * n, [[] for _ in range(n)]
        try:
            try:
                stream = await self.begin()
                async for out in stream:
                    if (delta := self._take(out, stream)) is not None:
                        if lead is not None:
                            lead.publish(delta, s.completion_tokens)
                        yield delta
                # the engine aborts what is left when it shuts down under a running request
                s.status = "aborted" if FinishReason.ABORT.value in s.reasons else "ok"
            except (asyncio.CancelledError, GeneratorExit):
                s.status = "aborted"
                raise
            except BaseException:
                s.status = "error"
                raise
            finally:
                # Shielded: a cancelled request must still be aborted, counted to its last generated
                # token (tokens still queued for a departed client included), priced and written down.
                # No stream: no tier took the requests (all down, or one refused them); `begin` settled.
                with anyio.CancelScope(shield=True):
                    if s.stream is not None:
                        await self._finish()
            if self._cache is not None and s.outcome is not None:
                with anyio.CancelScope(shield=True):
                    await cache_store.store(self._cache, self.plan, s.outcome)
        finally:
            if lead is not None:  # only now: a request arriving before the cache had the answer found it here
                lead.close()

    async def _follow(self, flight: Flight) -> AsyncIterator[ChoiceDelta]:
        """A streamed follower: the leader's deltas as they come, billed as a cache hit. If the leader is
        released (refused, failed, left), this request runs on its own, past what was already forwarded."""
        s = self._state
        s.started = time.perf_counter()
        sent = Forwarded(self.plan.work.num_choices)
        try:
            async for delta in flight.stream():
                sent.add(delta)
                yield delta
        except (asyncio.CancelledError, GeneratorExit):
            s.status = "aborted"
            with anyio.CancelScope(shield=True):
                await self._served(flight.partial(sent.texts, sent.reasons, self.plan.work.prompt_tokens))
            raise
        answer = flight.answer
        if answer is None and all(sent.reasons):  # released after every choice ended: nothing left to run
            answer = flight.partial(sent.texts, sent.reasons, self.plan.work.prompt_tokens)
        if answer is not None:
            s.status = "ok"
            with anyio.CancelScope(shield=True):
                await self._served(answer)
            return
        flight.count_release()
        self.plan = self.plan.on_own()
        async with aclosing(self._generate()) as own:
            async for delta in own:
                if (rest := sent.past(delta)) is not None:
                    yield rest

    async def _served(self, answer: CachedAnswer) -> None:
        """Bill a streamed follower as the cache hit it was: the leader's answer, on the leader's tier."""
        self.plan = self.plan.served_by(answer)
        self._state.completion_tokens = answer.completion_tokens
        await self._bill({}, answer.texts, answer.finish_reasons)

    async def collect(self) -> tuple[list[str], list[str | None]]:
        """Run to the end: each choice's text and finish reason."""
        texts = [""] * self.num_choices
        reasons: list[str | None] = [None] * self.num_choices
        async with aclosing(self.events()) as events:
            async for delta in events:
                texts[delta.index] += delta.text
                reasons[delta.index] = delta.finish_reason or reasons[delta.index]
        return texts, reasons

    def _take(self, out: RequestOutput, stream: OutputStream) -> ChoiceDelta | None:
        """Account one engine output; the delta it makes, if it says anything."""
        s = self._state
        s.completion_tokens = sum(o.completion_tokens for o in stream.last.values())
        if out.finish_reason is FinishReason.ERROR:
            raise APIError(500, "The engine failed while generating; please retry.", code="engine_error")
        i = self._index[out.request_id]
        s.reasons[i] = out.finish_reason.value if out.finish_reason else None
        s.texts[i] += out.text
        logprobs = out.logprobs if self.plan.work.requests[i].params.logprobs is not None else ()
        s.logprobs[i] += logprobs
        if out.text and s.ttft is None:
            assert s.started is not None
            s.ttft = time.perf_counter() - s.started
        return ChoiceDelta(i, out.text, s.reasons[i], logprobs) if out.text or s.reasons[i] or logprobs else None

    async def _replay(self, answer: CachedAnswer) -> AsyncIterator[ChoiceDelta]:
        """Answer from the cache: the stored texts as choice deltas; billed as a cache hit."""
        s = self._state
        s.started = time.perf_counter()
        s.completion_tokens = answer.completion_tokens
        try:
            for delta in replay_pieces(answer):
                yield delta
            s.status = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            s.status = "aborted"
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._bill({}, answer.texts, answer.finish_reasons)

    async def _finish(self) -> None:
        """Close the stream; run a finished answer's final checks (off the event loop: tests can take
        seconds); bill what ran."""
        s = self._state
        stream = s.stream
        assert stream is not None
        await stream.aclose()
        if s.status == "ok":
            # Checks that ask the serving tier something (`Context.ask`) do so from the worker thread.
            def spent(prompt: int, completion: int) -> None:  # on the event loop, after each question
                s.check_tokens = (s.check_tokens[0] + prompt, s.check_tokens[1] + completion)

            ask = tier_ask(s.serving.engine, salt=self.plan.work.requests[0].cache_salt, spent=spent)
            for hook in self.plan.checks.hooks:
                await anyio.to_thread.run_sync(hook.run_checks, ask)
            if cascade.escalates(self.plan.checks):
                s.status = "escalated"
        s.completion_tokens = sum(o.completion_tokens for o in stream.last.values())
        await self._bill(stream.last, s.texts, s.reasons)

    async def _bill(self, last: Mapping[str, RequestOutput], texts: list[str], reasons: list[str | None]) -> None:
        s = self._state
        assert s.started is not None
        s.outcome = Outcome(
            status=s.status,
            served=s.serving,
            texts=tuple(texts),
            finish_reasons=tuple(reasons),
            outputs=tuple(last.get(r.request_id) for r in self.plan.work.requests),
            completion_tokens=s.completion_tokens,
            seconds=time.perf_counter() - s.started,
            ttft=s.ttft,
            check_tokens=s.check_tokens,
        )
        s.settled = True
        if self.plan.lead is not None:  # followers get the answer (or are released) before the ledger write
            self.plan.lead.finish(cache_store.answer(self.plan, s.outcome))
        await self._meter.bill(self.plan, s.outcome)

    async def _drop_stream(self) -> None:
        """Close a stream that produced nothing; the next tier serves (and is billed) instead."""
        s = self._state
        stream, s.stream = s.stream, None
        if stream is not None:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    async def _release(self) -> None:
        """The request never ran: give its reservation back (and release its followers)."""
        self._state.settled = True
        if self.plan.lead is not None:
            self.plan.lead.release()
        await self._meter.release(self.plan.reservation)

    # --- after the response ---------------------------------------------------------------------------

    async def abandon(self) -> None:
        """Give back the reservation of a generation that never ran (its client left first); one that a tier
        took (`begin`) but nobody read is aborted and billed for what ran."""
        s = self._state
        if s.status != "pending" or s.settled:
            return
        if s.stream is not None:
            s.status = "aborted"
            s.reasons = [None] * self.plan.work.num_choices
            with anyio.CancelScope(shield=True):
                await self._finish()
            return
        s.status = "abandoned"
        await self._release()

    async def after_response(self) -> None:
        """Called once the response has gone out: the routing stage's follow-ups (stored prompt, shadow run)."""
        s = self._state
        if self.plan.route is not None and s.outcome is not None and not s.followed_up:
            s.followed_up = True
            after_response(self._routing, self.plan, s.outcome)

    async def close(self) -> None:
        """A streamed response ended, however: bill what ran or give the reservation back, then follow up."""
        await self.abandon()
        await self.after_response()
