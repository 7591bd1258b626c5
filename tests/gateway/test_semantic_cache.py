"""The semantic cache on real Redis: the guards, the calibrated threshold on the shipped pairs, a table
of requests that must and must not share an answer, tenant isolation, expiry, a second process, and a
dead Redis."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis

import services
from core.embedder import Embedder
from gateway.cache.calibrate import calibrate, calibration_report, load_pairs
from gateway.cache.guard import differing_sentences, differing_words, guard
from gateway.cache.normalize import request_key
from gateway.cache.semantic import DEFAULT_THRESHOLD, FLOOR, SemanticCache, frame_similarity, shares_answer
from policies.policy import CacheSettings

SETTINGS = CacheSettings(semantic=True)
PARAMS = {"temperature": 0, "max_tokens": 64}


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def key(text: str, **params: object) -> object:
    return request_key("chat.completions", "small", [{"role": "user", "content": text}], {**PARAMS, **params}, SETTINGS)


@pytest.mark.parametrize(
    ("a", "b", "why"),
    [
        ("What is 12 times 7?", "What is 12 times 8?", "numbers"),
        ("Sum 1,000 and 2", "Sum 1,000 and 3", "numbers"),
        ("Is Python fast?", "Is Python not fast?", "negation"),
        ("Can I do this?", "Can't I do this?", "negation"),
        ("Say 'hello'", "Say 'goodbye'", "quoted"),
        ('Grep for "error" in logs', 'Grep for "warning" in logs', "quoted"),
        ("Who founded Apple?", "Who founded Microsoft?", "entities"),
        ("Are you GPT-3?", "Are you GPT-4?", "numbers"),
        ("Are you GPT-2?", "Are you based on GPT-2?", "swapped"),
        ("Explain the API of NumPy.", "Explain the API of SciPy.", "entities"),
        ("Sort the list in ascending order", "Sort the list in descending order", "swapped"),
        ("Convert 5 miles to kilometers.", "Convert 5 kilometers to miles.", "swapped"),
        ("List three primary colors.", "List three secondary colors.", "swapped"),
        ("How do I install numpy?", "How do I uninstall numpy?", "swapped"),
        ("Print the numbers from one to ten.", "Print the numbers from one to 20.", "numbers"),
        ("What is 5 minus 2?", "What is 2 minus 5?", "numbers"),  # the same numbers in another order
        ("Call f(1, 2) on a long list", "Call f(2, 1) on a long list", "numbers"),
        ("Give me two examples.", "Give me three examples.", "numbers"),
        ("Is it safe to eat raw eggs?", "Is it not safe to eat raw eggs?", "negation"),
        ("How do I print without a newline?", "How do I print with a newline?", "negation"),
        ("Why shouldn't I use globals?", "Why should I use globals?", "negation"),
        ("Explain `git rebase`.", "Explain `git merge`.", "quoted"),
        ("What does “idempotent” mean?", "What does “immutable” mean?", "quoted"),
        ("How do I parse JSON in JavaScript?", "How do I parse JSON in Python?", "entities"),
        ("How do I read env vars in Node.js?", "How do I read env vars in Deno?", "entities"),
        ("Translate this sentence from English.", "Translate this sentence to English.", "swapped"),
        ("How do I remove duplicates from a list?", "How do I find duplicates in a list?", "swapped"),
        # false hits bench.savings found (MiniLM similarity above 0.80, two content words changed)
        ("How many meters are in 6 kilometers?", "How many centimeters are in 6 meters?", "swapped"),
        ("How many seconds are in 8 minutes?", "How many minutes are in 8 hours?", "swapped"),
        ("How many minutes are in 5 hours?", "Please, how many seconds are in 5 minutes?", "swapped"),
        ("How many minutes are in 5 hours? Be brief.", "How many seconds are in 5 minutes? Be brief.", "swapped"),
        ("How do I reverse a list in Python?", "What's the way to reverse a Python list?", None),
        ("What is twelve times seven?", "What is 12 times 7?", None),
        ("Sum 1,000 and 2", "Sum 1000 and 2", None),
        ("Give me one example.", "Give me an example.", None),
        ("Describe the water cycle.", "Explain the water cycle.", None),
        ("Write a haiku about autumn.", "Compose a haiku about autumn.", None),
        ("Is coffee bad for your health?", "Is coffee unhealthy?", None),
    ],
)
def test_guard(a: str, b: str, why: str | None) -> None:
    assert guard(a, b) == why
    assert guard(b, a) == why


INSTRUCTION = " Use simple words, be concrete, and avoid cliches."


@pytest.mark.parametrize(
    ("a", "b", "parts"),
    [
        ("What is the capital of France?", "Which city is the capital of France?", None),  # no shared sentence
        ("Be brief. What is up?", "be brief!  what is up ?", None),  # the same words
        ("Write one sentence about rain." + INSTRUCTION, "Write one sentence about the moon." + INSTRUCTION,
         ("Write one sentence about rain.", "Write one sentence about the moon.")),
        ("Review: good.\nSummarize it. Be brief.", "Review: awful, broke at once.\nSummarize it. Be brief.",
         ("good.", "awful, broke at once.")),
        ("Is it safe? Thanks!", "Is it safe?", ("Thanks!", "")),
    ],
)  # fmt: skip
def test_differing_sentences(a: str, b: str, parts: tuple[str, str] | None) -> None:
    assert differing_sentences(a, b) == parts
    assert differing_sentences(b, a) == (None if parts is None else parts[::-1])


def test_a_template_slot_filled_differently_is_judged_on_its_own(embedder: Embedder) -> None:
    """The false hit the suite once caught (tests/gateway/test_api_concurrency.py): two subjects in one
    template with a long shared instruction are 0.807 similar as wholes; what differs is not."""
    a = "Write one sentence about the city at night." + INSTRUCTION * 3
    b = "Write one sentence about a lighthouse." + INSTRUCTION * 3
    whole = embedder.encode([a, b])
    assert float(whole[0] @ whole[1]) >= DEFAULT_THRESHOLD and guard(a, b) is None  # what the frame rule is for
    local = frame_similarity(embedder, a, b)
    assert local is not None and local < DEFAULT_THRESHOLD - 0.1
    reworded = "Be brief. How many days does a leap year have?"
    assert frame_similarity(embedder, "Be brief. How many days are in a leap year?", reworded) >= DEFAULT_THRESHOLD
    assert frame_similarity(embedder, "Is it safe? Thanks!", "Is it safe?") == 1.0  # politeness only
    assert frame_similarity(embedder, "Hi! How are you today?", "Please, hi! How are you today?") == 1.0
    assert frame_similarity(embedder, "Is it safe? Answer in French.", "Is it safe?") == 0.0  # an added request
    assert frame_similarity(embedder, "How do I sort a list?", "How do I sort a Python list?") is None


# Past MiniLM's window (256 word pieces): plain words no guard reads (no numbers, negation or names).
VOCAB = ["river", "stone", "light", "garden", "window", "paper", "music", "forest", "cloud", "bridge", "table",
         "letter", "ocean", "mountain", "candle"]  # fmt: skip
RUN = " ".join(VOCAB[(i * 7) % len(VOCAB)] for i in range(600))  # 600 words, no sentence end
MORE = " ".join(VOCAB[(i * 5) % len(VOCAB)] for i in range(200))
LAST_WORD = " What is the last word of the text above?"
# A real document (this project's own README, about 2,000 words) asked about twice in other words.
# Its last line holds an opposite pair (before/after) whatever the README's opening says this week.
DOCUMENT = (Path(__file__).resolve().parents[2] / "README.md").read_text()[:9000] + (
    "\nRun the test command before and after every change."
)


def test_a_long_text_is_never_judged_by_its_first_window(embedder: Embedder) -> None:
    """The issue's pair: 600 words and "gamma" against the same 600, 200 more and "tau", asked the same. Their
    vectors are MiniLM's first 256 word pieces alone, so they are 1.0 similar; no guard and no sentence frame
    tells them apart, which is how the cache served B A's answer before what differs was judged on its own."""
    a, b = f"{RUN} gamma{LAST_WORD}", f"{RUN} {MORE} tau{LAST_WORD}"
    assert embedder.max_tokens() == 256 and not embedder.fits(a) and embedder.fits("gamma")
    va, vb = embedder.encode([a, b])
    assert float(va @ vb) > 0.9999 and guard(a, b) is None and differing_sentences(a, b) is None  # the hit before
    assert differing_words(a, b) == ("gamma", f"{MORE} tau")
    assert frame_similarity(embedder, a, b) < DEFAULT_THRESHOLD and not shares_answer(embedder, a, b, DEFAULT_THRESHOLD)
    # on its own line the question makes a frame, but what differs is itself past the window: cut by words
    a2, b2 = f"{RUN} gamma\n{LAST_WORD}", f"{RUN} {MORE} tau\n{LAST_WORD}"
    assert differing_sentences(a2, b2) is not None and not shares_answer(embedder, a2, b2, DEFAULT_THRESHOLD)


def test_lists_and_logs_changed_past_the_window_miss(embedder: Embedder) -> None:
    items = ", ".join(VOCAB[(i * 3) % len(VOCAB)] for i in range(300))
    ask = "\nWhich item appears most often?"
    appended = (f"{items}{ask}", f"{items}, {MORE.replace(' ', ', ')[:400]}{ask}")
    log = " ".join(f"host=web ip=local path=/{w} status=served" for w in VOCAB * 5)
    logs = (log + " level=info", log + " level=warn")  # one field past the window
    for a, b in (appended, logs):
        va, vb = embedder.encode([a, b])
        assert not embedder.fits(a) and float(va @ vb) >= DEFAULT_THRESHOLD  # a candidate, as before
        assert not shares_answer(embedder, a, b, DEFAULT_THRESHOLD), (a[-80:], b[-80:])
    minified = "f=function(a,b){return(a+b)};" * 120  # no whitespace: what differs is all of it, past the window
    assert not embedder.fits(minified) and frame_similarity(embedder, minified + "g()", minified + "h()") == 0.0


def test_a_long_document_asked_twice_in_other_words_still_hits(embedder: Embedder) -> None:
    a = f"{DOCUMENT}\n\nHow do I create a virtual environment in Python?"
    b = f"{DOCUMENT}\n\nHow can I make a Python virtual environment?"
    assert not embedder.fits(a) and "before" in DOCUMENT and "after" in DOCUMENT
    assert guard(a, b) is None  # opposites both texts carry are no swap (they once refused every long document)
    assert shares_answer(embedder, a, b, DEFAULT_THRESHOLD)
    assert shares_answer(embedder, a, a + " Thanks!", DEFAULT_THRESHOLD)  # politeness only
    c = f"{DOCUMENT}\n\nHow do I parse JSON in JavaScript?"
    assert not shares_answer(embedder, a, c, DEFAULT_THRESHOLD)  # another question about the same document


def test_calibrated_threshold_on_the_shipped_pairs(embedder: Embedder) -> None:
    pairs = load_pairs()
    assert len(pairs) >= 120 and sum(s for *_, s in pairs) >= 50
    threshold, report = calibrate(pairs, embedder)
    assert threshold == DEFAULT_THRESHOLD >= FLOOR
    assert report["false_hit_rate"] <= 0.01 and report["true_hit_rate"] >= 0.8, report
    again = calibration_report(embedder)  # what the hard-coded value's comment says to run
    assert again["threshold"] == DEFAULT_THRESHOLD and again["unfloored_threshold"] <= DEFAULT_THRESHOLD, again
    assert again["pairs"] == len(pairs) and again["false_hit_rate"] <= 0.01 and again["true_hit_rate"] >= 0.5


def test_embedder_vectors_and_threads(embedder: Embedder) -> None:
    texts = [f"How do I sort a list of {n} items?" for n in range(12)]
    vecs = embedder.encode(texts)
    assert vecs.shape == (12, 384) and vecs.dtype == np.float32
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    fresh = Embedder(cache_size=4)  # a tiny LRU: threads evict each other's texts while they read them
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: fresh.encode(texts[i % 12 : i % 12 + 3]), range(48)))
    for i, got in enumerate(results):
        assert np.allclose(got, vecs[i % 12 : i % 12 + 3], atol=1e-5)


# (stored, asked, must_hit); parameters equal unless the row says otherwise
TABLE = [
    ("How do I reverse a list in Python?", "What's the way to reverse a Python list?", True),
    ("How do I create a virtual environment in Python?", "How can I make a Python virtual environment?", True),
    ("Explain the difference between TCP and UDP.", "What is the difference between TCP and UDP?", True),
    ("How do I center a div in CSS?", "How can I center a div using CSS?", True),
    ("Who wrote Pride and Prejudice?", "Who is the author of Pride and Prejudice?", True),
    ("What is the square root of 144?", "What's the square root of 144?", True),
    ("How many days are in a leap year?", "How many days does a leap year have?", True),
    ("Describe the water cycle.", "Explain the water cycle.", True),
    ("What is the square root of 144?", "What is the square root of 169?", False),
    ("Is Python dynamically typed?", "Is Python not dynamically typed?", False),
    ("Is Python dynamically typed?", "Is Rust dynamically typed?", False),
    ("How do I undo the last git commit?", "How do I undo the last git push?", False),
    ("Convert 5 miles to kilometers.", "Convert 5 kilometers to miles.", False),
    ("Tell me a joke about cats.", "Tell me a joke about dogs.", False),
    ("What is the capital of France?", "What is the capital of Germany?", False),
    ("Translate 'good morning' to Spanish.", "Translate 'good night' to Spanish.", False),
    ("How do I parse JSON in JavaScript?", "How do I parse JSON in Python?", False),
    ("How do I sort a dictionary by value in Python?", "How do I sort a dictionary by key in Python?", False),
    ("What year did World War II end?", "What year did World War I end?", False),
    ("Is it safe to eat raw eggs?", "Can you safely eat raw eggs?", True),
    ("How do I rename a branch in git?", "How can I rename a git branch?", True),
    # templates: a slot filled differently never, a question reworded inside the same frame yes
    ("Write one sentence about the city at night." + INSTRUCTION * 3,
     "Write one sentence about a lighthouse." + INSTRUCTION * 3, False),
    ("Keep the answer short. How do I center a div in CSS?", "Keep the answer short. How can I center a div using CSS?",
     True),
    # past MiniLM's window: what differs decides
    (f"{RUN} gamma{LAST_WORD}", f"{RUN} {MORE} tau{LAST_WORD}", False),
    (f"{DOCUMENT}\n\nHow do I create a virtual environment in Python?",
     f"{DOCUMENT}\n\nHow can I make a Python virtual environment?", True),
]  # fmt: skip


def test_requests_that_must_and_must_not_share_an_answer(
    redis_server: str, redis_namespace: str, embedder: Embedder
) -> None:
    async def run() -> list[tuple[str, str, bool, object]]:
        c = SemanticCache(redis_server, redis_namespace, embedder)
        out = []
        for tenant, (stored, asked, must) in enumerate(TABLE, start=1):  # a tenant each: pairs stay apart
            await c.add(tenant, key(stored), ttl=60)
            out.append((stored, asked, must, await c.lookup(tenant, key(asked))))
        # a long shared system prompt must not make different questions alike
        system = {"role": "system", "content": "You are a helpful assistant for ACME Corp. " * 20}
        asks = [system, {"role": "user", "content": "Who created you?"}]
        other = [system, {"role": "user", "content": "What is up?"}]
        k = lambda m: request_key("chat.completions", "small", m, PARAMS, SETTINGS)  # noqa: E731
        await c.add(101, k(asks), ttl=60)
        out.append(("system prompt", "other question", False, await c.lookup(101, k(other))))
        # ... and a different system prompt makes the same question another request
        changed = [{"role": "system", "content": "You are a pirate."}, asks[1]]
        out.append(("system prompt", "other system prompt", False, await c.lookup(101, k(changed))))
        # same text, other parameters: never
        await c.add(100, key("How do I center a div in CSS?"), ttl=60)
        out.append(
            ("params", "max_tokens 65", False, await c.lookup(100, key("How do I center a div in CSS?", max_tokens=65)))
        )
        await c.close()
        return out

    for stored, asked, must, found in asyncio.run(run()):
        assert (found is not None) == must, (stored, asked, found)


def test_tenants_expiry_and_a_second_process(redis_server: str, redis_namespace: str, embedder: Embedder) -> None:
    stored, asked = "How do I merge two dictionaries in Python?", "What's the way to combine two dicts in Python?"

    async def run() -> None:
        one = SemanticCache(redis_server, redis_namespace, embedder)
        await one.add(1, key(stored), ttl=2)
        assert (await one.lookup(1, key(asked)))[0] == key(stored).key
        assert await one.lookup(2, key(asked)) is None  # another tenant
        two = SemanticCache(redis_server, redis_namespace, embedder)  # another gateway process
        assert (await two.lookup(1, key(asked)))[0] == key(stored).key
        assert await two.lookup(2, key(asked)) is None
        # an entry the second process adds reaches the first within its refresh interval
        await two.add(1, key("How do I boil an egg?"), ttl=60)
        await asyncio.sleep(one.REFRESH + 0.1)
        assert (await one.lookup(1, key("What's the best way to boil an egg?")))[0] == key("How do I boil an egg?").key
        await asyncio.sleep(1.2)
        assert await one.lookup(1, key(asked)) is None and await two.lookup(1, key(asked)) is None  # expired
        # a process loading the tenant afterwards skips the expired entry and prunes it from Redis
        three = SemanticCache(redis_server, redis_namespace, embedder)
        assert await three.lookup(1, key(asked)) is None
        client = redis.Redis.from_url(redis_server)
        assert not client.hexists(f"{redis_namespace}:sem:1", key(stored).key)
        assert client.hexists(f"{redis_namespace}:sem:1", key("How do I boil an egg?").key)
        assert not client.exists(f"{redis_namespace}:sem:2")  # nothing was ever stored for tenant 2
        modules = {m[b"name"].decode().lower() for m in client.module_list()}
        client.close()
        assert three.redisearch is bool(modules & {"search", "ft", "redisearch", "searchlight"})
        for c in (one, two, three):
            assert c.errors == 0
            await c.close()

    asyncio.run(run())


def test_a_dead_redis_is_a_miss_not_an_error(embedder: Embedder) -> None:
    embedder.encode(["How do I boil an egg?", "What's the best way to boil an egg?"])  # model loaded: time Redis

    async def timed(call: object) -> tuple[object, float]:
        start = time.monotonic()
        result = await call  # type: ignore[misc]
        return result, time.monotonic() - start

    async def run() -> None:
        c = SemanticCache(f"redis://127.0.0.1:{services.free_port()}/0", "down", embedder)
        _, took = await timed(c.lookup(1, key("What's the best way to boil an egg?")))
        assert took < 1.0
        _, took = await timed(c.add(1, key("How do I boil an egg?"), ttl=60))
        assert took < 1.0
        found, took = await timed(c.lookup(1, key("What's the best way to boil an egg?")))
        assert found is not None and took < 1.0  # this process's own entry still serves
        c._down_until = 0.0  # the backoff over: Redis is tried again, and still fails fast
        found, took = await timed(c.lookup(2, key("What's the best way to boil an egg?")))
        assert found is None and took < 1.0
        assert c.errors >= 2
        await c.close()

    asyncio.run(run())
