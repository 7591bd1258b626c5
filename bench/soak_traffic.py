"""`bench.soak`'s load: the clients' mix of requests against the gateway (`one`, `worker`), each recorded as
the client saw it (a `Call`), and the scenario: the policy change, then the Redis outage."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.load import say
from bench.soak_services import Postgres, RedisProcess, main_policy
from bench.soak_verdict import BAD_CASES, Call, Sample, Window

__all__ = [
    "CANCEL_MAX_TOKENS",
    "COMPLETION_MAX_TOKENS",
    "HIT_MAX_TOKENS",
    "HIT_PROMPTS",
    "KINDS",
    "OUTAGE_AT",
    "POLICY_AT",
    "POLICY_CAP",
    "STREAM_MAX_TOKENS",
    "TIERS",
    "TIER_WEIGHTS",
    "TOPICS",
    "Soak",
    "bad",
    "error_code",
    "headers",
    "one",
    "plain",
    "scenario",
    "streamed",
    "worker",
]

TIERS = ("tiny", "small")
TIER_WEIGHTS = (3, 2)

HIT_PROMPTS = (
    "Say hello in one short sentence.",
    "Name the capital of France.",
    "What is 2 + 2?",
    "Give me one word that rhymes with cat.",
    "Name a primary colour.",
    "What day comes after Monday?",
)
TOPICS = ("a lighthouse", "a robot", "the sea", "a library", "a garden", "a mountain", "a train", "a cat")

# kind → weight in the mix
KINDS: dict[str, int] = {"hit": 35, "stream": 20, "cancel": 10, "completion": 10, "bad": 12, "budget": 13}
HIT_MAX_TOKENS, STREAM_MAX_TOKENS, CANCEL_MAX_TOKENS, COMPLETION_MAX_TOKENS = 16, 24, 64, 16
POLICY_CAP = 10  # soak-main's max_tokens_cap after the policy change
POLICY_AT, OUTAGE_AT = 0.45, 0.50  # shares of the run


@dataclass
class Soak:
    url: str
    keys: dict[str, str]
    redis: RedisProcess
    pg: Postgres
    pid: int
    duration: float
    sample_every: float
    concurrency: int
    outage_seconds: float
    think: float
    t_start: float = 0.0
    calls: list[Call] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    outage: Window | None = None
    policy_at: float | None = None
    policy_version: int | None = None
    stopping: bool = False
    seq: int = 0
    last_cpu: tuple[float, float] | None = None  # (monotonic, gateway CPU seconds)

    def now(self) -> float:
        return time.monotonic() - self.t_start

    def fresh(self, rng: random.Random) -> str:
        self.seq += 1
        return f"Write one sentence about {rng.choice(TOPICS)}, take {self.seq}."


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def error_code(body: bytes) -> str:
    try:
        err = json.loads(body)["error"]
        return str(err.get("code") or err.get("type") or "")
    except (ValueError, KeyError, TypeError):
        return ""


async def plain(soak: Soak, http: httpx.AsyncClient, kind: str, tenant: str, path: str, body: dict[str, Any]) -> Call:
    call = Call(kind, tenant, soak.now(), 0.0, 0)
    try:
        r = await http.post(path, json=body, headers=headers(soak.keys[tenant]))
    except httpx.HTTPError as exc:
        call.t1, call.note = soak.now(), f"{type(exc).__name__}: {exc}"
        return call
    call.t1, call.status, call.cache = soak.now(), r.status_code, r.headers.get("x-switchboard-cache", "")
    if r.status_code == 200:
        answer = r.json()
        call.request_id = answer.get("id")
        call.completion_tokens = (answer.get("usage") or {}).get("completion_tokens")
    else:
        call.code = error_code(r.content)
    return call


async def streamed(
    soak: Soak, http: httpx.AsyncClient, kind: str, tenant: str, body: dict[str, Any], *, close_after: int = 0
) -> Call:
    """A streamed chat request, read to `[DONE]`; or, with `close_after`, closed after that many content chunks."""
    call = Call(kind, tenant, soak.now(), 0.0, 0)
    include_usage = bool(body.get("stream_options", {}).get("include_usage"))
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers(soak.keys[tenant])) as r:
            call.status, call.cache = r.status_code, r.headers.get("x-switchboard-cache", "")
            if r.status_code != 200:
                call.code = error_code(await r.aread())
                call.t1 = soak.now()
                return call
            call.request_id = r.headers.get("x-request-id")
            done, usage, chunks = False, None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    call.stream_error = f"error event: {event['error'].get('code') or event['error'].get('message')}"
                    continue
                if event.get("usage"):
                    usage = event["usage"]
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    chunks += 1
                    if close_after and chunks >= close_after:
                        break  # leaving the block closes the connection mid-stream
            if close_after:
                call.note = "closed" if not done else "finished"
            elif not done and not call.stream_error:
                call.stream_error = "no [DONE]"
            elif include_usage and usage is None and not call.stream_error:
                call.stream_error = "no usage chunk"
            if usage is not None:
                call.completion_tokens = usage.get("completion_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        # a 200 stream that broke still ran: its row is expected (status and id are set once headers came)
        call.note = f"{type(exc).__name__}: {exc}"
        if call.status == 200 and not close_after:
            call.stream_error = call.note
    call.t1 = soak.now()
    return call


async def bad(soak: Soak, http: httpx.AsyncClient, rng: random.Random) -> Call:
    case = rng.choice(sorted(BAD_CASES))
    body, extra, keyed, _ = BAD_CASES[case]
    call = Call(f"bad:{case}", "soak-main", soak.now(), 0.0, 0)
    hdrs = {**headers(soak.keys["soak-main"] if keyed else None), "content-type": "application/json", **extra}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        r = await http.post("/v1/chat/completions", content=content, headers=hdrs)
    except httpx.HTTPError as exc:
        call.t1, call.note = soak.now(), f"{type(exc).__name__}: {exc}"
        return call
    call.t1, call.status, call.code = soak.now(), r.status_code, error_code(r.content)
    if r.status_code == 200:  # it ran after all: the ledger has its row
        call.request_id = r.json().get("id")
    return call


async def one(soak: Soak, http: httpx.AsyncClient, rng: random.Random) -> Call:
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    tenant = rng.choice(("soak-main", "soak-main", "soak-open"))
    tier = rng.choices(TIERS, weights=TIER_WEIGHTS)[0]

    def chat(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
        return {"model": tier, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}

    if kind == "hit":
        body = chat(rng.choice(HIT_PROMPTS), HIT_MAX_TOKENS, temperature=0)
        if rng.random() < 0.2:
            return await streamed(soak, http, kind, tenant, {**body, "stream": True})
        return await plain(soak, http, kind, tenant, "/v1/chat/completions", body)
    if kind == "stream":
        body = chat(soak.fresh(rng), STREAM_MAX_TOKENS, temperature=1, stream=True, cache="no-store")
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return await streamed(soak, http, kind, tenant, body)
    if kind == "cancel":
        body = chat(soak.fresh(rng), CANCEL_MAX_TOKENS, temperature=1, stream=True, cache="no-store")
        return await streamed(soak, http, kind, tenant, body, close_after=1)
    if kind == "completion":
        body = {"model": tier, "prompt": soak.fresh(rng), "max_tokens": COMPLETION_MAX_TOKENS, "temperature": 0.7,
                "cache": "no-store"}  # fmt: skip
        return await plain(soak, http, kind, tenant, "/v1/completions", body)
    if kind == "bad":
        return await bad(soak, http, rng)
    body = chat(soak.fresh(rng), HIT_MAX_TOKENS, temperature=0, cache="no-store")
    return await plain(soak, http, "budget", "soak-tight", "/v1/chat/completions", body)


async def worker(soak: Soak, http: httpx.AsyncClient, i: int) -> None:
    rng = random.Random(1000 + i)
    while not soak.stopping:
        soak.calls.append(await one(soak, http, rng))
        await asyncio.sleep(rng.uniform(0, soak.think))


async def scenario(soak: Soak, admin: httpx.AsyncClient) -> None:
    """The policy change, then the Redis outage."""
    await asyncio.sleep(max(0.0, POLICY_AT * soak.duration - soak.now()))
    r = await admin.put("/v1/admin/tenants/soak-main/policy", json={**main_policy(POLICY_CAP), "note": "soak: cap"})
    soak.policy_at = soak.now()
    if r.status_code != 200:
        say(f"  policy change failed: HTTP {r.status_code} {r.text[:200]}")
    else:
        soak.policy_version = r.json().get("version")
        say(f"  [{soak.policy_at:6.0f}s] policy of soak-main changed: max_tokens_cap {POLICY_CAP}, "
            f"version {soak.policy_version}")  # fmt: skip
    await asyncio.sleep(max(0.0, OUTAGE_AT * soak.duration - soak.now()))
    killed = soak.now()
    soak.outage = Window(killed, math.inf)  # until it is back
    await asyncio.to_thread(soak.redis.kill)
    say(f"  [{killed:6.0f}s] redis-server killed")
    await asyncio.sleep(soak.outage_seconds)
    await asyncio.to_thread(soak.redis.start)
    soak.outage = Window(killed, soak.now())
    say(f"  [{soak.outage.end:6.0f}s] redis-server started again, empty")
