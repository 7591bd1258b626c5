"""Many clients at once through the official `openai` client: each gets its own answer, billed once.

Whole texts are compared with the same requests served one at a time: the bf16 engine is batch
invariant (tests/engines/test_engine.py), so greedy answers must not change under load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
from cpu_features import AMX_BF16

import services
from engines.async_engine import AsyncEngine
from live import LiveServer, start_server

TOPICS = [
    "the moon", "rain", "coffee", "a library", "bicycles", "winter", "the ocean", "a garden",
    "trains", "music", "mountains", "bread", "cats", "the city at night", "a river", "friendship",
    "clocks", "snow", "a lighthouse", "autumn", "bees", "the desert", "a violin", "stars",
    "a market", "thunder", "tea", "an old map", "kites", "the forest", "candles", "a bridge",
]  # fmt: skip


@pytest.fixture(scope="module")
def crowd_server(
    small_engine: AsyncEngine, postgres_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, AsyncEngine]]:
    """The gateway on PostgreSQL over the shared bf16 SmolLM2 engine."""
    from core.db.database import Database
    from core.settings import Settings
    from gateway.app import create_app

    engine = small_engine
    url, drop = services.create_database(postgres_server)
    db = Database(url)
    home = tmp_path_factory.mktemp("home")
    settings = Settings(home=home, database_url=url, tiers={"small": {"model": "unused"}})
    live, stop = start_server(create_app(settings, engines={"small": engine}, database=db), db)
    yield live, engine
    stop()
    db.dispose()
    drop()


def question(i: int) -> list[dict]:
    # Prompt lengths vary from a line to a paragraph, so prefills of many sizes share steps.
    extra = " Use simple words, be concrete, and avoid cliches." * (i % 5)
    return [{"role": "user", "content": f"Write one sentence about {TOPICS[i]}.{extra}"}]


def test_32_concurrent_streams_each_get_their_own_answer(crowd_server: tuple[LiveServer, AsyncEngine]) -> None:
    live, engine = crowd_server
    # two tenants: the crowd reuses none of the first tenant's prefixes (tests/gateway/test_isolation_live.py)
    alone_key, crowd_key = live.new_key(), live.new_key()

    async def ask(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, openai.types.CompletionUsage, str]:
        stream = await client.chat.completions.create(
            model="small",
            messages=question(i),
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, reason, usage, rid = "", None, None, ""
        async for chunk in stream:
            rid = chunk.id
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                reason = c.finish_reason or reason
        assert usage is not None
        return text, reason, usage, rid

    async def main() -> None:
        async with (
            openai.AsyncOpenAI(base_url=f"{live.base_url}/v1", api_key=alone_key, max_retries=0, timeout=300) as one,
            openai.AsyncOpenAI(base_url=f"{live.base_url}/v1", api_key=crowd_key, max_retries=0, timeout=300) as crowd,
        ):
            alone = [await ask(one, i) for i in range(32)]
            running = []

            async def watch() -> None:  # how many the engine really ran side by side
                while True:
                    running.append(engine.stats().running)
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            together = await asyncio.gather(*(ask(crowd, i) for i in range(32)))
            watcher.cancel()
        assert max(running) >= 16  # the requests really were batched, not served one by one
        assert len({t[3] for t in together}) == 32
        for (text, reason, usage, _), (a_text, a_reason, a_usage, _) in zip(together, alone, strict=True):
            assert text and usage.prompt_tokens == a_usage.prompt_tokens
            if not AMX_BF16:  # there, batching may change bf16 bits, so near-tie tokens (tests/cpu_features.py)
                assert (text, reason, usage.completion_tokens) == (a_text, a_reason, a_usage.completion_tokens)
        for _, _, usage, rid in together:
            (row,) = live.wait_for_usage(rid)
            assert (row.status, row.prompt_tokens, row.completion_tokens) == (
                "ok",
                usage.prompt_tokens,
                usage.completion_tokens,
            )

    asyncio.run(main())
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0


def test_concurrent_requests_get_their_own_answers(crowd_server: tuple[LiveServer, AsyncEngine]) -> None:
    live, _ = crowd_server
    key = live.new_key()
    questions = ["What is 2+2?", "Name a color.", "What is the capital of Italy?", "Say hello.", "Name a fruit."]

    async def ask(client: openai.AsyncOpenAI, question: str, stream: bool) -> str:
        messages = [{"role": "user", "content": question}]
        if not stream:
            r = await client.chat.completions.create(model="small", messages=messages, temperature=0, max_tokens=12)
            return r.choices[0].message.content or ""
        chunks = await client.chat.completions.create(
            model="small", messages=messages, temperature=0, max_tokens=12, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks])

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0) as client:
            alone = [await ask(client, q, False) for q in questions]
            together = await asyncio.gather(*(ask(client, q, i % 2 == 1) for i, q in enumerate(questions * 2)))
        assert together == alone * 2

    asyncio.run(main())
    assert httpx.get(f"{live.base_url}/healthz").status_code == 200
