"""Single flight: a cacheable request whose answer is being generated right now waits for that answer
instead of generating it again.

The rule: a request that would read the response cache (`miss`, with a key the answer would be stored
under) follows a request of the same tenant that is generating (its leader) when the leader's answer,
once stored, would be served to it from the cache: the same exact key (so the same tier, endpoint and
answer-changing parameters), or, with `cache.semantic`, a question the semantic cache's own test (same
context and parameters, similarity, `shares_answer`) matches. A follower is served the leader's answer as
a hit and billed as one; its ledger row's `cache_status` says `flight-hit` or `flight-sem-hit`:

    non-streamed  waits at admission for the leader's answer, then replays it like any cached answer
    streamed      waits at admission until the leader generates on the key's tier, then streams the
                  leader's deltas as they arrive (`Generation`), and is billed as a hit at the end

A leader that stores no answer releases its followers: refused at admission, failed, cancelled (its client
left), escalated by the cascade, or served by a fallback tier. Each follower then runs on its own, as the
plain miss it would have been; a streamed follower that already forwarded part of the leader's text
carries on with its own run's text past that part (`Forwarded`). The registry is one process's: replicas
each have their own leaders.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import numpy as np

from gateway.cache.exact import CachedAnswer
from gateway.cache.normalize import CacheKey
from gateway.cache.semantic import DEFAULT_THRESHOLD, SemanticCache, shares_answer, split_key
from gateway.cache.stage import CacheDecision
from gateway.pipeline.choices import Candidate, ChoiceDelta
from policies.policy import CacheSettings

log = logging.getLogger(__name__)

WAITING, STARTED, DONE, RELEASED = "waiting", "started", "done", "released"
FOLLOWER_STATUSES = ("flight-hit", "flight-sem-hit")  # a follower's cache status: exact, semantic


class Flight:
    """A leader's generation as its followers see it: its deltas so far, then its answer or its release."""

    def __init__(self, flights: Flights, tenant_id: int, key: CacheKey, settings: CacheSettings, leader: str) -> None:
        self.tenant_id = tenant_id
        self.key = key
        self.leader = leader  # the leading request's id
        # (question, context) when the answer goes into the semantic index too: semantic followers match on it
        self.semantic = split_key(key) if settings.semantic else None
        self.vector: np.ndarray | None = None  # the question's embedding, once a semantic follower needed it
        self.state = WAITING  # → started (on the key's tier) → done (an answer) | released (none)
        self.deltas: list[ChoiceDelta] = []
        self.completion_tokens = 0
        self.serving: Candidate | None = None  # the tier generating, once started
        self.answer: CachedAnswer | None = None
        self.joined = 0  # followers that came to wait for it
        self._flights = flights
        self._changed = asyncio.Event()

    # --- the leader's side ----------------------------------------------------------------------------

    def start(self, serving: Candidate) -> None:
        if self.state == WAITING:
            self.state, self.serving = STARTED, serving
            self._pulse()

    def publish(self, delta: ChoiceDelta, completion_tokens: int) -> None:
        if self.state in (WAITING, STARTED):
            self.deltas.append(delta)
            self.completion_tokens = completion_tokens
            self._pulse()

    def finish(self, answer: CachedAnswer | None) -> None:
        """The leader's run ended: with the answer it stores (followers get it), or with none (released)."""
        if answer is None:
            self.release()
        elif self.state in (WAITING, STARTED):
            self.state, self.answer = DONE, answer
            self._pulse()  # stays registered until `close`: arrivals before the cache has it still find it here

    def release(self) -> None:
        """No answer will come: followers run on their own, and newcomers no longer find this flight."""
        if self.state in (WAITING, STARTED):
            self.state = RELEASED
            self._pulse()
        self.close()

    def close(self) -> None:
        self._flights.drop(self)

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- the followers' side --------------------------------------------------------------------------

    async def _until(self, *states: str) -> None:
        while self.state not in states:
            await self._changed.wait()

    async def started(self) -> bool:
        """Wait until the leader generates on the key's tier (True) or is released first (False)."""
        await self._until(STARTED, DONE, RELEASED)
        return self.state != RELEASED

    async def result(self) -> CachedAnswer | None:
        """The leader's answer, or None once it is released."""
        await self._until(DONE, RELEASED)
        return self.answer

    async def stream(self) -> AsyncIterator[ChoiceDelta]:
        """Every delta the leader produced, from its first, as they come; ends when the leader does."""
        i = 0
        while True:
            while i < len(self.deltas):
                yield self.deltas[i]
                i += 1
            if self.state in (DONE, RELEASED):
                return
            await self._changed.wait()

    def partial(self, texts: list[str], reasons: list[str | None], prompt_tokens: int) -> CachedAnswer:
        """What a streamed follower was served when no whole answer came (it left early, or its leader was
        released after every choice had ended): the texts it forwarded."""
        tier = self.serving.name if self.serving is not None else ""
        return CachedAnswer(texts, reasons, prompt_tokens, self.completion_tokens, tier, self.leader, int(time.time()))

    def count_release(self) -> None:
        self._flights.released += 1


class Flights:
    """One process's leaders, per tenant by exact key."""

    def __init__(self) -> None:
        self._tenants: dict[int, dict[str, Flight]] = {}
        self.released = 0  # followers released to run on their own (their leader stored no answer)

    def __len__(self) -> int:
        return sum(len(t) for t in self._tenants.values())

    def in_air(self, tenant_id: int) -> list[Flight]:
        return list(self._tenants.get(tenant_id, {}).values())

    def lead(self, tenant_id: int, key: CacheKey, settings: CacheSettings, request_id: str) -> Flight | None:
        """Register a leader for `key`, unless another request already leads it."""
        flights = self._tenants.setdefault(tenant_id, {})
        if key.key in flights:
            return None
        flight = flights[key.key] = Flight(self, tenant_id, key, settings, request_id)
        return flight

    def drop(self, flight: Flight) -> None:
        flights = self._tenants.get(flight.tenant_id, {})
        if flights.get(flight.key.key) is flight:
            del flights[flight.key.key]
            if not flights:
                del self._tenants[flight.tenant_id]

    async def find(
        self, tenant_id: int, key: CacheKey, settings: CacheSettings, semantic: SemanticCache | None
    ) -> tuple[Flight, float | None] | None:
        """The flight whose answer the cache would serve this request: (flight, None) for the exact key,
        (flight, similarity) for a semantic match; None if there is none."""
        if (flight := self._tenants.get(tenant_id, {}).get(key.key)) is not None:
            return flight, None
        if not settings.semantic or semantic is None:
            return None
        try:
            if (found := await self._similar(tenant_id, key, settings, semantic)) is not None:
                return found
        except Exception:  # like the semantic cache, never a reason to fail the request: it runs on its own
            log.warning("single flight: semantic match failed; the request runs on its own", exc_info=True)
        # the embedding took a moment: an identical request may have come to lead meanwhile
        flight = self._tenants.get(tenant_id, {}).get(key.key)
        return None if flight is None else (flight, None)

    async def _similar(
        self, tenant_id: int, key: CacheKey, settings: CacheSettings, semantic: SemanticCache
    ) -> tuple[Flight, float] | None:
        """The semantic cache's test, against the questions of the flights in the air (same context only)."""
        if (split := split_key(key)) is None:
            return None
        question, context = split
        flights = [
            (f, f.semantic[0])
            for f in self._tenants.get(tenant_id, {}).values()
            if f.semantic is not None and f.semantic[1] == context
        ]
        if not flights:
            return None  # the common case: nothing to embed
        missing = [(f, q) for f, q in flights if f.vector is None]  # taken before the await: others may fill them
        vectors = await anyio.to_thread.run_sync(semantic.embedder.encode, [question] + [q for _, q in missing])
        for (f, _), vec in zip(missing, vectors[1:], strict=True):
            f.vector = vec
        threshold = DEFAULT_THRESHOLD if settings.semantic_threshold is None else settings.semantic_threshold
        scored = sorted(((float(f.vector @ vectors[0]), i) for i, (f, _) in enumerate(flights)), reverse=True)
        for similarity, i in scored:
            f, their = flights[i]
            if similarity < threshold:
                break
            if f.state == RELEASED:
                continue
            if await anyio.to_thread.run_sync(shares_answer, semantic.embedder, their, question, threshold):
                return f, similarity
        return None


@dataclass(frozen=True)
class Seat:
    """A request's place in single flight: its cache decision, and the flight it leads or follows, if any."""

    cache: CacheDecision
    lead: Flight | None = None
    follow: Flight | None = None  # a streamed follower's leader, whose deltas it streams


async def join(
    flights: Flights,
    semantic: SemanticCache | None,
    tenant_id: int,
    request_id: str,
    decision: CacheDecision,
    *,
    stream: bool,
) -> Seat:
    """Follow the flight whose answer the cache would serve this request (see the module's docstring), or
    lead one for its key. A follower whose leader is released runs on its own, leading nothing."""
    key, settings = decision.key, decision.settings
    if key is None or settings is None or settings.max_entries <= 0:
        return Seat(decision)  # no answer would be stored: none to share
    if decision.status == "miss":  # it reads the cache (`no-cache` does not): it may follow
        found = await flights.find(tenant_id, key, settings, semantic)
        if found is not None:
            return await _follow(*found, decision, stream=stream)
    return Seat(decision, lead=flights.lead(tenant_id, key, settings, request_id))


async def _follow(flight: Flight, similarity: float | None, decision: CacheDecision, *, stream: bool) -> Seat:
    status = FOLLOWER_STATUSES[similarity is not None]
    flight.joined += 1
    if stream and await flight.started() and flight.state == STARTED:
        # Streamed as it comes; the key stays, for the case the leader is released and this runs on its own.
        pending = CacheDecision(status, key=decision.key, similarity=similarity, settings=decision.settings)
        return Seat(pending, follow=flight)
    answer = await flight.result()
    if answer is None:
        flight.count_release()
        return Seat(decision)
    return Seat(CacheDecision(status, answer=answer, similarity=similarity, settings=decision.settings))


class Forwarded:
    """What a streamed follower forwarded of its leader's text; once released, its own run's deltas past that.

    A deterministic request's own run begins with the text its leader produced; where it does not (a numeric
    near-tie decided the other way), what was sent stands, the own run's text continues after it, and a
    warning says so.
    """

    def __init__(self, n: int) -> None:
        self.texts = [""] * n
        self.reasons: list[str | None] = [None] * n
        self._own = [""] * n
        self._checked = [False] * n

    def add(self, delta: ChoiceDelta) -> None:
        self.texts[delta.index] += delta.text
        self.reasons[delta.index] = delta.finish_reason or self.reasons[delta.index]

    def past(self, delta: ChoiceDelta) -> ChoiceDelta | None:
        """The part of an own-run delta the client has not seen; None if nothing (a choice already ended)."""
        i = delta.index
        if self.reasons[i] is not None:
            return None
        before, sent = len(self._own[i]), self.texts[i]
        self._own[i] += delta.text
        if not self._checked[i] and len(self._own[i]) >= len(sent):
            self._checked[i] = True
            if not self._own[i].startswith(sent):
                log.warning("single flight: a follower's own run differs from the %d chars its leader sent",
                            len(sent))  # fmt: skip
        text = self._own[i][max(before, len(sent)) :]
        return ChoiceDelta(i, text, delta.finish_reason) if text or delta.finish_reason else None
