"""The response cache: which requests share a key (normalization) and how the store behaves on real
Redis, in process, and while Redis is down or hung."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import time
import unicodedata
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

import services
from gateway.cache.exact import CachedAnswer, ResponseCache
from gateway.cache.normalize import CacheKey, is_deterministic, normalize_text, request_key
from policies.policy import CacheSettings

DEFAULT = CacheSettings()

# --- keys -------------------------------------------------------------------------------------------------


@dataclass
class Req:
    conversation: Any
    params: dict[str, Any] = field(default_factory=lambda: {"temperature": 0, "max_tokens": 64})
    tier: str = "small"
    endpoint: str = "chat"
    settings: CacheSettings = field(default_factory=CacheSettings)

    def key(self) -> CacheKey:
        return request_key(self.endpoint, self.tier, self.conversation, self.params, self.settings)


def chat(text: str, system: str | None = None, **params: Any) -> Req:
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": text}
    ]
    return Req(messages, params or {"temperature": 0, "max_tokens": 64})


def sys_prompt(stamp: str) -> Req:
    return chat("Summarize the incident.", system=f"You are the on-call assistant. Context: {stamp}. Be brief.")


CODE_A = "def f(xs):\n    for x in xs:\n        if x:\n            return x\n    return None\n"
CODE_B = "def f(xs):\n    for x in xs:\n        if x:\n            return x\n        return None\n"

PAIRS: list[tuple[str, Req, Req, bool]] = [
    # --- must hit: differences that cannot change the answer
    ("inner whitespace", chat("What is  the capital of\tFrance?"), chat("What is the capital of France?"), True),
    ("trailing spaces and newlines", chat("Hello there  \n\n\n"), chat("Hello there"), True),
    ("leading blank lines", chat("\n\n  Hello there"), chat("Hello there"), True),
    ("CRLF vs LF", chat("line one\r\nline two"), chat("line one\nline two"), True),
    ("blank-line runs", chat("para one\n\n\n\n\npara two"), chat("para one\n\npara two"), True),
    (
        "NFC vs NFD accents",
        chat(unicodedata.normalize("NFC", "Un café à Orléans?")),
        chat(unicodedata.normalize("NFD", "Un café à Orléans?")),
        True,
    ),
    ("ISO timestamps", sys_prompt("now 2026-11-24T10:28:06Z"), sys_prompt("now 2027-01-03T23:59:59.123+01:00"), True),
    ("log timestamps", sys_prompt("at 2026-11-24 10:28:06"), sys_prompt("at 2026-11-25 08:01:17"), True),
    ("clock times", sys_prompt("time 10:28:06"), sys_prompt("time 23:05:59"), True),
    ("date(1) output", sys_prompt("Tue Nov 24 10:28:06 UTC 2026"), sys_prompt("Wed Dec 2 09:00:00 UTC 2026"), True),
    ("ISO dates", sys_prompt("today is 2026-11-24"), sys_prompt("today is 2026-12-01"), True),
    ("numeric dates", sys_prompt("today is 24/11/2026"), sys_prompt("today is 03/12/2026"), True),
    ("written dates", sys_prompt("today is Nov 24, 2026"), sys_prompt("today is December 1, 2026"), True),
    (
        "UUIDs",
        sys_prompt("session 123e4567-e89b-12d3-a456-426614174000"),
        sys_prompt("session 9b2c0f4e-1d3a-4c5b-8e7f-0a1b2c3d4e5f"),
        True,
    ),
    ("prefixed request ids", sys_prompt("req_abc123XYZ"), sys_prompt("req_Q9w8E7r6"), True),
    ("labelled request ids", sys_prompt("request-id: 8f3a21bc9d"), sys_prompt("request-id: 77aa01ff23"), True),
    ("trace ids", sys_prompt("trace-00f3a9b2c4 span-1a2b3c4d"), sys_prompt("trace-99e8d7c6b5 span-5e6f7a8b"), True),
    (
        "long hex",
        sys_prompt("commit 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b"),
        sys_prompt("commit 2c26b46b68ffc68ff99b453c1d30413413422d70"),
        True,
    ),
    (
        "long base64",
        sys_prompt("token eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9"),
        sys_prompt("token QmFzZTY0IGVuY29kZWQgc3RyaW5nIDEyMw=="),
        True,
    ),
    (
        "JSON body key order",
        Req([{"role": "user", "content": "hi"}], {"temperature": 0, "max_tokens": 64, "top_p": 0.9}),
        Req([{"content": "hi", "role": "user"}], {"top_p": 0.9, "max_tokens": 64, "temperature": 0}),
        True,
    ),
    (
        "temperature 0 vs 0.0",
        chat("hi", temperature=0, max_tokens=64),
        chat("hi", temperature=0.0, max_tokens=64),
        True,
    ),
    ("top_p 1 vs 1.0", chat("hi", temperature=0, top_p=1), chat("hi", temperature=0, top_p=1.0), True),
    (
        "stop order and repeats",
        chat("hi", temperature=0, stop=["\n", "END"]),
        chat("hi", temperature=0, stop=["END", "\n", "END"]),
        True,
    ),
    ("stop string vs list", chat("hi", temperature=0, stop="END"), chat("hi", temperature=0, stop=["END"]), True),
    ("None params dropped", chat("hi", temperature=0, seed=None), chat("hi", temperature=0), True),
    ("stream and user", chat("hi", temperature=0, stream=True, user="u1"), chat("hi", temperature=0), True),
    (
        "developer is system",
        Req([{"role": "developer", "content": "Be brief."}]),
        Req([{"role": "system", "content": "Be brief."}]),
        True,
    ),
    (
        "text parts vs string",
        Req([{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]}]),
        Req([{"role": "user", "content": "Hello world"}]),
        True,
    ),
    # --- must not hit: differences that may change the answer
    ("different numbers", chat("what is 12 times 7"), chat("what is 12 times 8"), False),
    ("numbers in a system prompt", chat("go", system="You get 3 tries."), chat("go", system="You get 5 tries."), False),
    ("long decimal numbers", chat("is 12345678901234567 prime?"), chat("is 12345678901234569 prime?"), False),
    ("HH:MM times", chat("what is 3:45 plus 1:20?"), chat("what is 3:45 plus 1:25?"), False),
    ("different names", chat("Write a poem for Alice."), chat("Write a poem for Bob."), False),
    ("negation", chat("Explain why the sky is blue."), chat("Explain why the sky is not blue."), False),
    ("dates in the user's question", chat("Which weekday is 2026-11-24?"), chat("Which weekday is 2026-11-25?"), False),
    (
        "base64 in the user's question",
        chat("Decode eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9"),
        chat("Decode QmFzZTY0IGVuY29kZWQgc3RyaW5nIDEyMw=="),
        False,
    ),
    ("spacing inside a string literal", chat('print("a  b")'), chat('print("a b")'), False),
    ("temperature", chat("hi", temperature=0, max_tokens=64), chat("hi", temperature=0.7, max_tokens=64), False),
    ("max_tokens", chat("hi", temperature=0, max_tokens=64), chat("hi", temperature=0, max_tokens=65), False),
    ("top_p", chat("hi", temperature=0, top_p=1.0), chat("hi", temperature=0, top_p=0.9), False),
    ("seed", chat("hi", temperature=0.8, seed=1), chat("hi", temperature=0.8, seed=2), False),
    ("stop", chat("hi", temperature=0, stop=["END"]), chat("hi", temperature=0, stop=["STOP"]), False),
    ("n", chat("hi", temperature=0, n=1), chat("hi", temperature=0, n=2), False),
    (
        "tier",
        Req([{"role": "user", "content": "hi"}], tier="small"),
        Req([{"role": "user", "content": "hi"}], tier="large"),
        False,
    ),
    ("endpoint", Req("hi", endpoint="completions"), Req(["hi"], endpoint="completions"), False),
    (
        "role of a message",
        Req([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]),
        Req([{"role": "user", "content": "hi"}, {"role": "user", "content": "Hello!"}]),
        False,
    ),
    (
        "speaker name",
        Req([{"role": "user", "content": "hi", "name": "ann"}]),
        Req([{"role": "user", "content": "hi", "name": "bo"}]),
        False,
    ),
    (
        "code indentation",
        chat(f"What does this return for [0]?\n{CODE_A}"),
        chat(f"What does this return for [0]?\n{CODE_B}"),
        False,
    ),
    (
        "fenced code alignment",
        chat("Output?\n```\nprint('a' + ' ' * 2)\nx  = 1\n```"),
        chat("Output?\n```\nprint('a' + ' ' * 2)\nx = 1\n```"),
        False,
    ),
    ("token-id prompts", Req([1, 2, 3], endpoint="completions"), Req([1, 2, 4], endpoint="completions"), False),
    (
        "masks off",
        Req(sys_prompt("now 2026-11-24T10:28:06Z").conversation, settings=CacheSettings(masks=[])),
        Req(sys_prompt("now 2026-11-25T10:28:06Z").conversation, settings=CacheSettings(masks=[])),
        False,
    ),
    (
        "whitespace folding off",
        Req(chat("a  b").conversation, settings=CacheSettings(fold_whitespace=False)),
        Req(chat("a b").conversation, settings=CacheSettings(fold_whitespace=False)),
        False,
    ),
]


@pytest.mark.parametrize(("a", "b", "must_hit"), [p[1:] for p in PAIRS], ids=[p[0] for p in PAIRS])
def test_exact_key(a: Req, b: Req, must_hit: bool) -> None:
    ka, kb = a.key(), b.key()
    assert (ka.key == kb.key) is must_hit, f"\n{ka.canonical}\n{kb.canonical}"
    assert (ka.canonical == kb.canonical) is must_hit


def sent(req: Req) -> str:
    """The request as a client sent it, before any normalization."""
    return json.dumps([req.endpoint, req.tier, req.conversation, req.params, req.settings.model_dump(mode="json")])


def test_pair_table_covers_both_outcomes() -> None:
    """Every pair differs as sent (a must-hit pair already identical would test no normalization), and the
    keys computed split the table both ways, a dozen pairs or more on each side."""
    same = [name for name, a, b, _ in PAIRS if sent(a) == sent(b)]
    assert not same, f"pairs identical as sent: {same}"
    hits = [name for name, a, b, _ in PAIRS if a.key().key == b.key().key]
    assert len(hits) >= 12 and len(PAIRS) - len(hits) >= 12, hits


def test_key_fields() -> None:
    k = request_key(
        "chat",
        "small",
        [{"role": "developer", "content": "Now: 2026-11-24T10:28:06Z."}, {"role": "user", "content": "Hi  there "}],
        {"temperature": 0.0, "stop": ["b", "a"], "max_tokens": 8, "stream": True},
        DEFAULT,
    )
    assert k.text == "system: Now: «ts».\nuser: Hi there"
    assert k.params == '{"endpoint":"chat","params":{"max_tokens":8,"stop":["a","b"],"temperature":0},"tier":"small"}'
    assert k.canonical == (
        '{"endpoint":"chat","input":[{"content":"Now: «ts».","role":"system"},{"content":"Hi there","role":"user"}],'
        '"params":{"max_tokens":8,"stop":["a","b"],"temperature":0},"tier":"small"}'
    )
    assert k.key == hashlib.sha256(k.canonical.encode()).hexdigest()
    assert request_key("completions", "small", [5, 6], {}, DEFAULT).text == "5 6"


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("at 2026-11-24T10:28:06Z", "at «ts»"),
        ("at 2026-11-24 10:28:06,123 +0100 ok", "at «ts» ok"),
        ("Tue Nov 24 10:28:06 UTC 2026", "«ts»"),
        ("Tue, 24 Nov 2026 10:28:06 GMT", "«ts»"),
        ('127.0.0.1 - - [24/Nov/2026:10:28:06 +0000] "GET /"', '127.0.0.1 - - [«ts»] "GET /"'),
        ("on 2026-11-24, 24/11/2026, Nov 24, 2026 and 24 November 2026", "on «date», «date», «date» and «date»"),
        ("id 123E4567-E89B-12D3-A456-426614174000.", "id «uuid»."),
        ("req_abc123XYZ, x-request-id: 5f2b1c9a, trace_id='ab12cd34'", "«id», x-request-id: «id», trace_id=«id»"),
        ("sha 0x9F86D081884C7D659A2FEAA0 end", "sha «hex» end"),
        ("key dGhpcyBpcyBhIHRlc3QgMTIzNDU2Nzg5MA== end", "key «b64» end"),
        # left alone: ordinary numbers, words, paths, versions, HH:MM
        ("12 times 7 is 84; pi is 3.14159; 1234567890123456789", None),
        ("request-response, trace id format, span-of-control, deadbeefcafebabe", None),
        ("/usr/local/lib/python3.11/site-packages and v1.2.3 at 10:30", None),
        ("SomeVeryLongCamelCaseIdentifierName and snake_case_identifier_name_here", None),
    ],
)
def test_masks(text: str, masked: str | None) -> None:
    assert normalize_text(text) == (text if masked is None else masked)
    assert normalize_text(text, masks=()) == text


def test_whitespace_folding_keeps_indentation() -> None:
    assert normalize_text("  a  b  \n    c\t d\n\n\n\n  e  ") == "a b\n  c d\n\ne"
    assert normalize_text("x:\n\ty  =  1", masks=()) == "x:\n\ty = 1"
    assert normalize_text("a  b", fold_whitespace=False) == "a  b"
    with pytest.raises(ValueError):
        normalize_text("x", masks=["nope"])


def test_is_deterministic() -> None:
    assert is_deterministic(0, None) and is_deterministic(0.0, None)
    assert is_deterministic(0.7, 42) and is_deterministic(None, 0)
    assert not is_deterministic(None, None) and not is_deterministic(0.7, None)


# --- the store ----------------------------------------------------------------------------------------------


def answer(text: str = "Paris.", request_id: str = "req-1") -> CachedAnswer:
    return CachedAnswer([text], ["stop"], 12, 3, "small", request_id, 1_790_000_000)


def run(make: Callable[[], ResponseCache], body: Callable[[ResponseCache], Awaitable[None]]) -> None:
    async def main() -> None:
        cache = make()
        try:
            await body(cache)
        finally:
            await cache.close()

    asyncio.run(main())


@pytest.fixture(params=["redis", "local"])
def make_cache(request: pytest.FixtureRequest) -> Callable[[], ResponseCache]:
    if request.param == "local":
        return lambda: ResponseCache(None)
    url = request.getfixturevalue("redis_server")
    ns = request.getfixturevalue("redis_namespace")
    return lambda: ResponseCache(url, namespace=ns)


def test_cached_answer_json() -> None:
    a = CachedAnswer(["ünï", "b"], ["stop", None], 5, 7, "large", "req-x", 1_700_000_000)
    assert CachedAnswer.from_json(a.to_json()) == a


def test_round_trip(make_cache: Callable[[], ResponseCache]) -> None:
    async def body(cache: ResponseCache) -> None:
        assert await cache.get(1, "k1") is None
        await cache.put(1, "k1", answer(), ttl=60, max_entries=10)
        assert await cache.get(1, "k1") == answer()
        await cache.put(1, "k1", answer("Lyon.", "req-2"), ttl=60, max_entries=10)  # overwrite
        got = await cache.get(1, "k1")
        assert got is not None and got.texts == ["Lyon."] and got.request_id == "req-2"
        assert cache.available and cache.errors == 0

    run(make_cache, body)


def test_tenant_isolation(make_cache: Callable[[], ResponseCache]) -> None:
    async def body(cache: ResponseCache) -> None:
        await cache.put(1, "same", answer("for tenant 1"), ttl=60, max_entries=10)
        assert await cache.get(2, "same") is None
        await cache.put(2, "same", answer("for tenant 2"), ttl=60, max_entries=10)
        a1, a2 = await cache.get(1, "same"), await cache.get(2, "same")
        assert a1 is not None and a1.texts == ["for tenant 1"]
        assert a2 is not None and a2.texts == ["for tenant 2"]

    run(make_cache, body)


def test_ttl_expiry(make_cache: Callable[[], ResponseCache]) -> None:
    async def body(cache: ResponseCache) -> None:
        await cache.put(1, "short", answer(), ttl=1, max_entries=10)
        await cache.put(1, "long", answer(), ttl=60, max_entries=10)
        assert await cache.get(1, "short") is not None
        await asyncio.sleep(1.5)
        assert await cache.get(1, "short") is None
        assert await cache.get(1, "long") is not None

    run(make_cache, body)


def test_max_entries_keeps_the_newest(make_cache: Callable[[], ResponseCache]) -> None:
    async def body(cache: ResponseCache) -> None:
        for i in range(5):
            await cache.put(7, f"k{i}", answer(f"a{i}"), ttl=60, max_entries=3)
        assert [await cache.get(7, f"k{i}") is not None for i in range(5)] == [False, False, True, True, True]
        await cache.put(7, "k2", answer("again"), ttl=60, max_entries=3)  # re-stored: now the newest
        await cache.put(7, "k5", answer(), ttl=60, max_entries=3)
        assert [await cache.get(7, k) is not None for k in ("k2", "k3", "k4", "k5")] == [True, False, True, True]
        await cache.put(8, "other", answer(), ttl=60, max_entries=3)  # another tenant's cap is its own
        assert await cache.get(7, "k4") is not None
        await cache.put(9, "none", answer(), ttl=60, max_entries=0)  # a cap of 0 stores nothing
        assert await cache.get(9, "none") is None

    run(make_cache, body)


def test_redis_layout(redis_server: str, redis_namespace: str) -> None:
    """Entries under the tenant's key with the TTL; the index is capped and forgets expired entries."""
    client = redis.Redis.from_url(redis_server, decode_responses=True)

    async def body(cache: ResponseCache) -> None:
        await cache.put(3, "gone", answer(), ttl=1, max_entries=10)
        await asyncio.sleep(1.5)
        for i in range(4):
            await cache.put(3, f"k{i}", answer(), ttl=30, max_entries=2)
        index = f"{redis_namespace}:cache-index:3"
        assert client.zrange(index, 0, -1) == ["k2", "k3"]
        assert 0 < client.ttl(f"{redis_namespace}:cache:3:k3") <= 30
        assert 0 < client.ttl(index) <= 30
        assert not client.exists(f"{redis_namespace}:cache:3:k0")
        client.set(f"{redis_namespace}:cache:3:bad", "{not json")
        assert await cache.get(3, "bad") is None  # an unreadable entry is a miss

    try:
        run(lambda: ResponseCache(redis_server, namespace=redis_namespace), body)
    finally:
        client.close()


# --- faults ---------------------------------------------------------------------------------------------------


class ThrowawayRedis(services.RedisServer):
    """A redis-server of our own on a fixed port, to kill, freeze and restart (no binary: fails, saying so)."""

    def freeze(self, frozen: bool) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP if frozen else signal.SIGCONT)


@pytest.fixture
def throwaway_redis() -> Iterator[ThrowawayRedis]:
    server = ThrowawayRedis()
    server.start()
    yield server
    server.kill()


async def timed(call: Awaitable[Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    result = await call
    return result, time.monotonic() - t0


async def wait_out_backoff(cache: ResponseCache) -> None:
    await asyncio.sleep(max(0.0, cache._down_until - time.monotonic()) + 0.05)


def test_redis_killed_and_restarted(throwaway_redis: ThrowawayRedis) -> None:
    async def body(cache: ResponseCache) -> None:
        await cache.put(1, "k", answer(), ttl=60, max_entries=10)
        assert await cache.get(1, "k") == answer()

        throwaway_redis.kill()
        got, elapsed = await timed(cache.get(1, "k"))
        assert got is None and elapsed < 0.6
        assert cache.errors == 1 and not cache.available
        _, elapsed = await timed(cache.put(1, "k2", answer(), ttl=60, max_entries=10))
        assert elapsed < 0.6
        # During the backoff Redis is not even tried: instant misses, no new errors.
        for _ in range(20):
            got, elapsed = await timed(cache.get(1, "k"))
            assert got is None and elapsed < 0.01
            await cache.put(1, "k", answer(), ttl=60, max_entries=10)
        assert cache.errors == 1
        # Many concurrent requests while down: all misses, all fast.
        await wait_out_backoff(cache)
        results, elapsed = await timed(asyncio.gather(*(cache.get(1, f"c{i}") for i in range(100))))
        assert results == [None] * 100 and elapsed < 0.6

        throwaway_redis.start()  # same port, empty
        await wait_out_backoff(cache)
        await cache.put(1, "k", answer("back"), ttl=60, max_entries=10)
        got = await cache.get(1, "k")
        assert got is not None and got.texts == ["back"] and cache.available
        # And under concurrency: the pool is healthy again.
        await asyncio.gather(*(cache.put(1, f"c{i}", answer(), ttl=60, max_entries=1000) for i in range(100)))
        assert all(r is not None for r in await asyncio.gather(*(cache.get(1, f"c{i}") for i in range(100))))

    run(lambda: ResponseCache(throwaway_redis.url, namespace="faults"), body)


def test_backoff_doubles_and_client_is_rebuilt(throwaway_redis: ThrowawayRedis) -> None:
    async def body(cache: ResponseCache) -> None:
        cache.BACKOFF_MIN, cache.BACKOFF_MAX = 0.1, 0.4
        await cache.put(1, "k", answer(), ttl=60, max_entries=10)
        throwaway_redis.kill()
        backoffs = []
        for _ in range(5):
            await cache.get(1, "k")
            backoffs.append(cache._backoff)
            await wait_out_backoff(cache)
        assert backoffs == [0.1, 0.2, 0.4, 0.4, 0.4]
        assert cache.errors == 5
        throwaway_redis.start()
        await cache.put(1, "k", answer("after rebuild"), ttl=60, max_entries=10)
        got = await cache.get(1, "k")
        assert got is not None and got.texts == ["after rebuild"] and cache.available

    run(lambda: ResponseCache(throwaway_redis.url, namespace="faults"), body)


def test_redis_down_from_the_start() -> None:
    port = services.free_port()  # nothing listens here

    async def body(cache: ResponseCache) -> None:
        got, elapsed = await timed(cache.get(1, "k"))
        assert got is None and elapsed < 0.6 and cache.errors == 1
        _, elapsed = await timed(cache.put(1, "k", answer(), ttl=60, max_entries=10))
        assert elapsed < 0.01  # in the backoff

    run(lambda: ResponseCache(f"redis://127.0.0.1:{port}/0"), body)


def test_redis_hung(throwaway_redis: ThrowawayRedis) -> None:
    """A Redis that accepts but never answers costs one socket timeout, then the backoff; it recovers."""

    async def body(cache: ResponseCache) -> None:
        await cache.put(1, "k", answer(), ttl=60, max_entries=10)
        throwaway_redis.freeze(True)
        try:
            results, elapsed = await timed(asyncio.gather(*(cache.get(1, "k") for _ in range(10))))
            assert results == [None] * 10 and elapsed < 1.0
            got, elapsed = await timed(cache.get(1, "k"))
            assert got is None and elapsed < 0.01
        finally:
            throwaway_redis.freeze(False)
        await wait_out_backoff(cache)
        assert await cache.get(1, "k") == answer() and cache.available

    run(lambda: ResponseCache(throwaway_redis.url, namespace="faults"), body)
