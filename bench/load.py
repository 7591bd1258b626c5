"""Load on a live gateway: N concurrent clients, cache hits and engine streams; RPS, latency, TTFT, errors.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.load [--mode hit|stream|both] [--concurrency 64]
        [--duration 15] [--rate R] [--procs P] [--sqlite] [--url URL --key KEY]

Without `--url` it starts its own gateway: a fresh PostgreSQL database (`tests/services.py`; `--sqlite` for
SQLite), Redis with a namespace of its own, the tiny profile (SmolLM2-135M as tier `small`), and one tenant
whose policy has hard daily and monthly budgets and rate limits (all far from refusing), so every request
goes through auth, policy, budgets, the cache and the ledger. The gateway runs `switchboard serve` in a
separate process, so the load generator does not share its GIL; the database and Redis keys are removed
at the end.

Cache-hit path (`hit`): every request is the same deterministic chat request (temperature 0, max_tokens
8), sent once untimed first, so each timed request is an exact hit (`x-switchboard-cache: hit`; anything
else is counted as a non-hit). Closed loop by default: each of N clients sends its next request when the
last one answers, for `--duration` seconds. With `--rate R` the loop is open: request k is due at k/R
seconds and its latency counts from then, so queueing behind a slow server shows up (no coordinated
omission).

Engine path (`stream`): N concurrent streaming requests (stream=true, max_tokens 32, temperature 1,
distinct seeds, `cache: "no-store"`), all started at once. TTFT is the time to the first chunk with
content; an error is a non-200 answer, an `error` event in the stream, or a stream without `[DONE]`.

The load generator costs CPU too: on a 2-core machine it competes with the gateway for the same cores,
so the hit-path RPS is a lower bound for the gateway alone. `--procs P` splits the clients over P
processes (for more cores; on 2 cores one process is usually best). Progress goes to stderr; the table
and a last line of JSON (`hit_rps`, `hit_p99_ms`, `stream_errors`, `stream_ttft_p99_ms`, ...) to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import httpx

from bench import from_tests
from bench.serve import SERVE, far_limits, launch_serve, serve_env

ROOT = Path(__file__).resolve().parent.parent

HIT_BODY = {
    "model": "small",
    "messages": [{"role": "user", "content": "Say hello in one short sentence."}],
    "temperature": 0,
    "max_tokens": 8,
}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# --- the cache-hit path ----------------------------------------------------------------------------


@dataclass
class HitResult:
    latencies_ms: list[float] = field(default_factory=list)  # hits only
    non_hits: int = 0
    errors: int = 0
    error_examples: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    gateway_cpu_ms: float | None = None  # own gateway: its CPU time per request (threads included)

    def merge(self, other: HitResult) -> None:
        self.latencies_ms += other.latencies_ms
        self.non_hits += other.non_hits
        self.errors += other.errors
        self.error_examples += other.error_examples[: 5 - len(self.error_examples)]
        self.elapsed_s = max(self.elapsed_s, other.elapsed_s)


def client(url: str, key: str, concurrency: int, timeout: float = 60) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=timeout, http2=False
    )


class KeepAlive:
    """One HTTP/1.1 keep-alive connection that speaks just enough of the protocol for the hit path: a
    fixed request, answers with a Content-Length. httpx spends more CPU per request than the gateway's
    whole hit path does; on 2 shared cores it, not the gateway, would be what this measures."""

    def __init__(self, url: str, request: bytes) -> None:
        parsed = httpx.URL(url)
        self.host, self.port = parsed.host, parsed.port or 80
        self.request = request
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self) -> tuple[int, dict[str, str], bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        try:
            self.writer.write(self.request)
            head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            status = int(head[0].split(" ", 2)[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
            body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        except BaseException:
            self.close()
            raise
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, headers, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def hit_request(url: str, key: str) -> bytes:
    body = json.dumps(HIT_BODY).encode()
    host = httpx.URL(url).netloc.decode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def hit_load(
    url: str, key: str, concurrency: int, duration: float, rate: float | None, progress: bool = True
) -> HitResult:
    res = HitResult()
    request = hit_request(url, key)
    next_k = 0
    t0 = time.perf_counter()
    end = t0 + duration

    async def worker() -> None:
        nonlocal next_k
        conn = KeepAlive(url, request)
        while True:
            if rate is None:
                due = time.perf_counter()
                if due >= end:
                    break
            else:
                k, next_k = next_k, next_k + 1
                due = t0 + k / rate
                if due >= end:
                    break
                if (wait := due - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
            try:
                status, headers, body = await conn.send()
                ms = (time.perf_counter() - due) * 1000
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
                res.errors += 1
                if len(res.error_examples) < 5:
                    res.error_examples.append(f"{type(exc).__name__}: {exc}")
                continue
            if status != 200:
                res.errors += 1
                if len(res.error_examples) < 5:
                    res.error_examples.append(f"HTTP {status}: {body[:200]!r}")
            elif headers.get("x-switchboard-cache") != "hit":
                res.non_hits += 1
            else:
                res.latencies_ms.append(ms)
        conn.close()

    async def ticker() -> None:
        while True:
            await asyncio.sleep(3)
            done = len(res.latencies_ms) + res.non_hits + res.errors
            say(f"  hit: {time.perf_counter() - t0:5.1f}s  {done} requests  {res.errors} errors")

    tick = asyncio.create_task(ticker()) if progress else None
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    res.elapsed_s = time.perf_counter() - t0
    if tick:
        tick.cancel()
    return res


def run_async(coro: Any) -> Any:
    """uvloop where installed: the load generator should cost as little CPU as it can."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _hit_proc(url: str, key: str, concurrency: int, duration: float, rate: float | None, first: bool) -> HitResult:
    return run_async(hit_load(url, key, concurrency, duration, rate, progress=first))


def run_hit(url: str, key: str, concurrency: int, duration: float, rate: float | None, procs: int) -> HitResult:
    warm = httpx.post(f"{url}/v1/chat/completions", json=HIT_BODY, headers={"Authorization": f"Bearer {key}"},
                      timeout=300)  # fmt: skip
    warm.raise_for_status()
    again = httpx.post(f"{url}/v1/chat/completions", json=HIT_BODY, headers={"Authorization": f"Bearer {key}"})
    say(f"warm-up: first {warm.headers.get('x-switchboard-cache')}, then {again.headers.get('x-switchboard-cache')}")
    if procs <= 1:
        return run_async(hit_load(url, key, concurrency, duration, rate))
    shares = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    with ProcessPoolExecutor(procs, mp_context=get_context("spawn")) as pool:
        futures = [
            pool.submit(_hit_proc, url, key, n, duration, rate / procs if rate else None, i == 0)
            for i, n in enumerate(shares)
        ]
        total = HitResult()
        for f in futures:
            total.merge(f.result())
    return total


# --- the engine path -------------------------------------------------------------------------------


@dataclass
class StreamResult:
    ttft_ms: list[float] = field(default_factory=list)
    total_ms: list[float] = field(default_factory=list)
    tokens: int = 0  # content chunks received
    errors: int = 0
    error_examples: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


async def stream_load(url: str, key: str, concurrency: int, max_tokens: int) -> StreamResult:
    res = StreamResult()
    done = 0

    def fail(why: str) -> None:
        res.errors += 1
        if len(res.error_examples) < 5:
            res.error_examples.append(why)

    async with client(url, key, concurrency, timeout=600) as http:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            nonlocal done
            body = {
                "model": "small",
                "messages": [{"role": "user", "content": f"Write a short story about a robot, number {i}."}],
                "temperature": 1,
                "seed": 1000 + i,
                "max_tokens": max_tokens,
                "stream": True,
                "cache": "no-store",
            }
            start = time.perf_counter()
            first: float | None = None
            finished = False
            chunks = 0
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        fail(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                        return
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            finished = True
                            break
                        event = json.loads(data)
                        if "error" in event:
                            fail(f"stream error: {event['error']}")
                            return
                        if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                            chunks += 1
                            if first is None:
                                first = time.perf_counter()
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                fail(f"{type(exc).__name__}: {exc}")
                return
            if not finished:
                fail("stream ended without [DONE]")
                return
            end = time.perf_counter()
            res.ttft_ms.append(((first or end) - start) * 1000)
            res.total_ms.append((end - start) * 1000)
            res.tokens += chunks
            done += 1

        async def ticker() -> None:
            while True:
                await asyncio.sleep(3)
                say(f"  stream: {time.perf_counter() - t0:5.1f}s  {done}/{concurrency} complete  {res.errors} errors")

        tick = asyncio.create_task(ticker())
        await asyncio.gather(*(one(i) for i in range(concurrency)))
        res.elapsed_s = time.perf_counter() - t0
        tick.cancel()
    return res


# --- a gateway of its own --------------------------------------------------------------------------


@dataclass
class Gateway:
    url: str
    key: str
    pid: int
    stop: Callable[[], None]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its threads so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_gateway(home: Path, sqlite: bool, log: Path, cprofile: Path | None = None) -> Gateway:
    from core.db.database import Database
    from gateway.accounting.tenants import create_tenant
    from policies.policy import Policy
    from policies.store import PolicyStore

    services = from_tests("services")
    cleanups: list[Callable[[], None]] = []
    tmp = tempfile.TemporaryDirectory(prefix="sb-bench-load-")
    cleanups.append(tmp.cleanup)
    if sqlite:
        db_url = f"sqlite:///{tmp.name}/switchboard.db"
    else:
        db_url, drop = services.create_database(services.postgres_url())
        cleanups.append(drop)
    redis_url, namespace = services.redis_url(), f"sbbench-load-{uuid.uuid4().hex[:8]}"
    cleanups.append(lambda: services.delete_namespace(redis_url, namespace))
    cleanups.append(services.stop_all)

    db = Database(db_url)
    db.upgrade()
    issued = create_tenant(db, "bench-load")
    from gateway.accounting.tenants import authenticate

    principal = authenticate(db, issued.key)
    assert principal is not None
    policy = Policy(**far_limits())
    PolicyStore(db).save(principal.tenant_id, policy, "bench", note="bench/load.py")
    db.engine.dispose()

    port = services.free_port()
    # no router training competing with the load
    env = serve_env(home, db_url, port, SWITCHBOARD_REDIS_URL=redis_url, SWITCHBOARD_REDIS_NAMESPACE=namespace,
                    SWITCHBOARD_PROFILE="tiny", SWITCHBOARD_ROUTER_AUTO_TRAIN="false")  # fmt: skip
    serve = SERVE
    if cprofile is not None:  # the event loop's thread only; stats are written when the server stops
        serve = (
            "import cProfile; from gateway.cli import main; prof = cProfile.Profile(); prof.enable()\n"
            f"try:\n    main(['serve'])\nfinally:\n    prof.disable(); prof.dump_stats({str(cprofile)!r})"
        )
    # uvicorn re-raises the signal it stopped on: SIGINT lets the profiling wrapper's `finally` run
    stop_signal = signal.SIGINT if cprofile is not None else signal.SIGTERM
    proc, url, stop = launch_serve(serve, env, tmp.name, port, log, cleanups, stop_signal=stop_signal, ready_s=300)
    return Gateway(url, issued.key, proc.pid, stop)


# --- report ----------------------------------------------------------------------------------------


def report(args: argparse.Namespace, hit: HitResult | None, stream: StreamResult | None) -> dict:
    summary: dict[str, float | int | str] = {"concurrency": args.concurrency, "cpus": os.cpu_count() or 0}
    print("\n| mode | concurrency | requests | RPS | p50 ms | p90 ms | p99 ms | TTFT p50 ms | TTFT p99 ms | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    if hit is not None:
        lat = hit.latencies_ms
        rps = len(lat) / hit.elapsed_s if hit.elapsed_s else 0.0
        p50, p90, p99 = (pct(lat, q) for q in (0.5, 0.9, 0.99))
        loop = f"open {args.rate:g}/s" if args.rate else "closed"
        print(f"| hit ({loop}) | {args.concurrency} | {len(lat)} | {rps:.0f} | {p50:.1f} | {p90:.1f} | {p99:.1f} "
              f"| | | {hit.errors} (+{hit.non_hits} non-hits) |")  # fmt: skip
        summary |= {"hit_rps": round(rps, 1), "hit_p50_ms": round(p50, 2), "hit_p90_ms": round(p90, 2),
                    "hit_p99_ms": round(p99, 2), "hit_requests": len(lat), "hit_errors": hit.errors,
                    "hit_non_hits": hit.non_hits}  # fmt: skip
        if hit.gateway_cpu_ms is not None:
            say(f"  gateway CPU per hit: {hit.gateway_cpu_ms:.2f} ms")
            summary["hit_gateway_cpu_ms"] = round(hit.gateway_cpu_ms, 3)
        for e in hit.error_examples:
            say(f"  hit error: {e}")
    if stream is not None:
        n = len(stream.total_ms)
        t50, t99 = pct(stream.ttft_ms, 0.5), pct(stream.ttft_ms, 0.99)
        tot50, tot99 = pct(stream.total_ms, 0.5), pct(stream.total_ms, 0.99)
        tot90 = pct(stream.total_ms, 0.9)
        print(f"| stream | {args.concurrency} | {n} | {n / stream.elapsed_s:.1f} | {tot50:.0f} | {tot90:.0f} | "
              f"{tot99:.0f} | {t50:.0f} | {t99:.0f} | {stream.errors} |")  # fmt: skip
        summary |= {"stream_errors": stream.errors, "stream_completed": n, "stream_ttft_p50_ms": round(t50, 1),
                    "stream_ttft_p99_ms": round(t99, 1), "stream_total_p50_ms": round(tot50, 1),
                    "stream_total_p99_ms": round(tot99, 1),
                    "stream_tokens_per_s": round(stream.tokens / stream.elapsed_s, 1)}  # fmt: skip
        for e in stream.error_examples:
            say(f"  stream error: {e}")
    print("(stream row: p50/p90/p99 are whole-request times; RPS is completed streams per second)")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="a running gateway (default: start one)")
    p.add_argument("--key", help="an API key for --url")
    p.add_argument("--mode", choices=("hit", "stream", "both"), default="both")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent clients (hit) and streams (stream)")
    p.add_argument("--duration", type=float, default=15, help="seconds of hit-path load")
    p.add_argument("--rate", type=float, help="hit path: requests per second, open loop (default: closed loop)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per stream")
    p.add_argument("--procs", type=int, default=1, help="split the hit-path clients over this many processes")
    p.add_argument("--sqlite", action="store_true", help="own gateway: SQLite instead of PostgreSQL")
    p.add_argument("--home", type=Path, default=Path("~/.cache/switchboard"))
    p.add_argument("--pause", type=float, default=0, help="seconds to wait before the hit load (to attach a profiler)")
    p.add_argument("--cprofile", type=Path, help="own gateway: profile its event loop into this file (pstats)")
    args = p.parse_args()
    if bool(args.url) != bool(args.key):
        p.error("--url and --key go together")

    gw: Gateway | None = None
    if args.url:
        url, key = args.url.rstrip("/"), args.key
    else:
        log = Path(tempfile.gettempdir()) / f"sb-bench-load-{os.getpid()}.log"
        say(f"starting a gateway ({'SQLite' if args.sqlite else 'PostgreSQL'}, Redis, tiny profile); log {log}")
        gw = start_gateway(args.home.expanduser(), args.sqlite, log, args.cprofile)
        url, key = gw.url, gw.key
        say(f"gateway pid {gw.pid} at {url}")
    try:
        hit = stream = None
        if args.mode in ("hit", "both"):
            if args.pause:
                say(f"pausing {args.pause:g}s")
                time.sleep(args.pause)
            say(f"hit path: {args.concurrency} clients for {args.duration:g}s")
            cpu = cpu_seconds(gw.pid) if gw else None
            hit = run_hit(url, key, args.concurrency, args.duration, args.rate, args.procs)
            if gw is not None and cpu is not None and hit.latencies_ms:
                hit.gateway_cpu_ms = (cpu_seconds(gw.pid) - cpu) * 1000 / (len(hit.latencies_ms) + hit.non_hits + 2)
        if args.mode in ("stream", "both"):
            say(f"engine path: {args.concurrency} concurrent streams of {args.max_tokens} tokens")
            stream = asyncio.run(stream_load(url, key, args.concurrency, args.max_tokens))
    finally:
        if gw is not None:
            gw.stop()
    print(json.dumps(report(args, hit, stream)))


if __name__ == "__main__":
    main()
