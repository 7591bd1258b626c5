"""Soak: a live gateway under mixed load for a set time; does anything grow or go missing?

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.soak [--minutes 30] [--sample-seconds 30] [--concurrency 4]
        [--outage-seconds 10] [--plot bench/results/soak.png] [--home ~/.cache/switchboard]

It starts `switchboard serve` in a subprocess (as `bench.load` does) on a fresh PostgreSQL database of its own
(`soak_<pid>`, dropped at the end) and a redis-server of its own on a free port (no persistence), with two
in-process tiers: `tiny` (SmolLM2-135M, bf16) and `small` (Qwen2.5-Coder-0.5B, int4), sharing a 32 MiB KV
pool: small, so that every page of the pools is touched during the warm-up (touched pages stay resident by
design, engines/kv/budget.py; the default 1 GiB pool would fill for the whole run and read as growth).
Three app tenants: `soak-main` (hard daily and monthly budgets and rate limits, all far from refusing),
`soak-open` (no limits) and `soak-tight` (a hard daily budget of a few requests' tokens), plus an operator
admin key for the admin API.

`--concurrency` clients (default 4) each pick their next request at random, with a short pause between:
  hit         one of a few fixed deterministic prompts (exact-cache hits after the first; a fifth streamed)
  stream      a fresh prompt, streamed (`cache: no-store`), half with `stream_options.include_usage`
  cancel      a fresh prompt, streamed, closed by the client after its first content chunk
  completion  a fresh prompt on `/v1/completions`, not streamed
  bad         malformed JSON, a refused field, a wrong type, an unknown model, no key, a wrong content type:
              each expects its documented 4xx
  budget      `soak-tight`: a few 200s, then 429 `insufficient_quota`
At 45% of the run `soak-main`'s policy is changed through the admin API (`max_tokens_cap`); from then on its
answers must respect the cap. At 50% the Redis server is killed (SIGKILL), and started again on the same port,
empty, `--outage-seconds` later: `soak-main` and `soak-tight` (tenants with limits) may get 503
`budget_unavailable` from the kill until 10 s after the restart (docs/operations.md, "Redis down"); any other
5xx, an error event inside a stream, or a 503 outside that window is unexpected.

Every `--sample-seconds` (one progress line each): the gateway process's RSS, open file descriptors and CPU,
PostgreSQL connections to the soak database (`pg_stat_activity`), KV blocks in use, i.e. referenced by a
sequence (`GET /v1/engine/stats`: `kv_blocks_used`; cached blocks nobody references are free and counted
apart), and Redis keys (DBSIZE). After the load: wait until every tier is idle, take a last sample, and check
the ledger (docs/api.md: every request that ran writes exactly one row, cache hits and requests the client
abandoned mid-stream included; refusals write none): the request id of every 200 (non-streamed, stream run
to `[DONE]`, stream the client closed) must have exactly one row. Rows the client never saw answered are
reported as unexpected, not as lost.

Prints the table of samples and the checks, writes a PNG of the samples over time (`--plot`), and as its last
line one JSON object: `minutes`, `rss_growth_pct` and `fd_growth` (from the end of the warm-up, the first 20%
of the run, to the end of the load), `lost_rows` (expected ledger rows missing; duplicates are reported
apart), `unexpected_5xx`, `kv_blocks_leaked` (blocks in use once idle after the load, against idle before).
Targets for 30 minutes: rss_growth_pct ≤ 5, fd_growth ≤ 5, lost_rows = 0, unexpected_5xx = 0,
kv_blocks_leaked = 0. Progress goes to stderr; the gateway's log to a file it names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench import from_tests
from bench.load import say
from bench.serve import SERVE, launch_serve, serve_env
from bench.soak_report import fmt, log_summary, outage_check, plot, policy_check, report_calls, table
from bench.soak_services import TIGHT_TOKENS, Postgres, RedisProcess, create_tenants, free_port
from bench.soak_traffic import Soak, headers, scenario, worker
from bench.soak_verdict import OUTAGE_GRACE_S, Sample, growth, unexpected_5xx, verdict

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """\
kv_pool_bytes = "32MiB"

[tiers.tiny]
model = "smollm2-135m-instruct"

[tiers.small]
model = "qwen2.5-coder-0.5b-instruct"
weights = "int4"
"""
NAMESPACE = "soak"  # the gateway's Redis keys (its own server: nothing else there)


def proc_stats(pid: int) -> tuple[float, int, float]:
    """(RSS MB, open file descriptors, CPU seconds) of a process: psutil where installed, else /proc."""
    try:
        import psutil
    except ImportError:
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd")), cpu
    p = psutil.Process(pid)
    with p.oneshot():
        times = p.cpu_times()
        return p.memory_info().rss / 2**20, p.num_fds(), times.user + times.system


async def engine_stats(admin: httpx.AsyncClient) -> tuple[int, int, int] | None:
    """(KV blocks in use, KV blocks cached, sequences running or waiting), summed over the tiers."""
    try:
        r = await admin.get("/v1/engine/stats")
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    tiers = r.json().values()
    return (
        sum(t["kv_blocks_used"] for t in tiers),
        sum(t["kv_blocks_cached"] for t in tiers),
        sum(t["running"] + t.get("waiting", 0) for t in tiers),
    )


async def sample(soak: Soak, admin: httpx.AsyncClient, phase: str) -> Sample:
    rss, fds, cpu = await asyncio.to_thread(proc_stats, soak.pid)
    now = time.monotonic()
    cpu_pct = 0.0
    if soak.last_cpu is not None and now > soak.last_cpu[0]:
        cpu_pct = (cpu - soak.last_cpu[1]) / (now - soak.last_cpu[0]) * 100
    soak.last_cpu = (now, cpu)
    pg = await asyncio.to_thread(soak.pg.connections)
    kv = await engine_stats(admin)
    keys = await asyncio.to_thread(soak.redis.dbsize) if soak.redis.proc is not None else None
    s = Sample(
        t=soak.now(),
        phase=phase,
        rss_mb=rss,
        fds=fds,
        cpu_pct=cpu_pct,
        pg_conns=pg,
        kv_used=kv[0] if kv else None,
        kv_cached=kv[1] if kv else None,
        running=kv[2] if kv else None,
        redis_keys=keys,
        requests=len(soak.calls),
        bad_5xx=unexpected_5xx(soak.calls, soak.outage),
    )
    soak.samples.append(s)
    say(f"  [{s.t:6.0f}s] {phase:10s} RSS {s.rss_mb:7.1f} MB  fds {s.fds:4d}  CPU {s.cpu_pct:5.1f}%  "
        f"pg {fmt(s.pg_conns)}  KV used {fmt(s.kv_used)} cached {fmt(s.kv_cached)}  running {fmt(s.running)}  "
        f"redis keys {fmt(s.redis_keys)}  requests {s.requests}  unexpected 5xx {s.bad_5xx}")  # fmt: skip
    return s


async def sampler(soak: Soak, admin: httpx.AsyncClient) -> None:
    k = 1
    while True:
        due = k * soak.sample_every
        if due > soak.duration:
            return
        await asyncio.sleep(max(0.0, due - soak.now()))
        w = soak.outage
        outage = soak.redis.proc is None or (w is not None and w.start <= soak.now() <= w.end + OUTAGE_GRACE_S)
        await sample(soak, admin, "outage" if outage else "load")
        k += 1


async def until_idle(admin: httpx.AsyncClient, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = await engine_stats(admin)
        if stats is not None and stats[2] == 0:
            return True
        await asyncio.sleep(0.5)
    return False


async def run(soak: Soak) -> int:
    """The load and its samples; returns the KV blocks in use at idle before the load."""
    limits = httpx.Limits(max_connections=soak.concurrency * 2, max_keepalive_connections=soak.concurrency * 2)
    timeout = httpx.Timeout(300, connect=10)
    async with (
        httpx.AsyncClient(base_url=soak.url, limits=limits, timeout=timeout) as http,
        httpx.AsyncClient(base_url=soak.url, headers=headers(soak.keys["admin"]), timeout=30) as admin,
    ):
        soak.t_start = time.monotonic()
        before = await sample(soak, admin, "idle")
        if before.kv_used is None:
            raise RuntimeError("GET /v1/engine/stats did not answer")
        workers = [asyncio.create_task(worker(soak, http, i)) for i in range(soak.concurrency)]
        events = asyncio.create_task(scenario(soak, admin))
        await sampler(soak, admin)  # its last sample is at the end of the load, under load
        soak.stopping = True
        say("load stopped; waiting for the requests in flight")
        await asyncio.wait_for(asyncio.gather(*workers), 600)
        if not events.done():  # a run too short for its scenario
            events.cancel()
            if soak.redis.proc is None:
                await asyncio.to_thread(soak.redis.start)
    async with httpx.AsyncClient(base_url=soak.url, headers=headers(soak.keys["admin"]), timeout=30) as admin:
        if not await until_idle(admin, 120):
            say("  the engines did not go idle within 120 s")
        await asyncio.sleep(3)  # ledger rows are group-committed
        await sample(soak, admin, "idle-after")
    return before.kv_used


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=30, help="minutes of load")
    p.add_argument("--sample-seconds", type=float, default=30, help="seconds between samples")
    p.add_argument("--concurrency", type=int, default=4, help="clients sending at once")
    p.add_argument("--think", type=float, default=0.3, help="most seconds a client pauses between requests")
    p.add_argument("--outage-seconds", type=float, default=10, help="how long Redis stays down at the midpoint")
    p.add_argument("--warmup", type=float, default=0.2, help="share of the run before the growth baseline")
    p.add_argument("--plot", type=Path, default=ROOT / "bench" / "results" / "soak.png", help="the PNG of the samples")
    p.add_argument("--home", type=Path, default=Path("~/.cache/switchboard"), help="where the models are")
    args = p.parse_args()
    duration, warmup_s = args.minutes * 60, args.minutes * 60 * args.warmup

    services = from_tests("services")
    tmp = Path(tempfile.mkdtemp(prefix="sb-bench-soak-"))
    log = Path(tempfile.gettempdir()) / f"sb-bench-soak-{os.getpid()}.log"
    cleanups: list[Callable[[], None]] = [lambda: shutil.rmtree(tmp, ignore_errors=True), services.stop_all]
    redis = pg = None
    stop: Callable[[], None] | None = None
    try:
        pg = Postgres(services.postgres_url())
        cleanups.append(pg.drop)
        redis = RedisProcess(tmp / "redis.log")
        redis.start()
        cleanups.append(redis.stop)
        from gateway.accounting.tenants import use_key_secret

        secret = secrets.token_hex(16)
        use_key_secret(secret, args.home)
        keys = create_tenants(pg.url)
        (tmp / "switchboard.toml").write_text(CONFIG)
        port = free_port()
        env = serve_env(
            args.home.expanduser(), pg.url, port,
            SWITCHBOARD_CONFIG=str(tmp / "switchboard.toml"), SWITCHBOARD_REDIS_URL=redis.url,
            SWITCHBOARD_REDIS_NAMESPACE=NAMESPACE, SWITCHBOARD_KEY_SECRET=secret,
            SWITCHBOARD_ROUTER_AUTO_TRAIN="false", SWITCHBOARD_TUNING_CHECK_SECONDS="0",
        )  # fmt: skip
        say(f"starting a gateway (tiers tiny + small, PostgreSQL {pg.name}, redis-server :{redis.port}); log {log}")
        started = time.monotonic()
        proc, url, stop = launch_serve(SERVE, env, str(tmp), port, log, [])
        say(f"gateway pid {proc.pid} at {url}, healthy after {time.monotonic() - started:.0f}s; "
            f"{args.minutes:g} min of load, a sample every {args.sample_seconds:g}s")  # fmt: skip
        soak = Soak(url, keys, redis, pg, proc.pid, duration, args.sample_seconds, args.concurrency,
                    args.outage_seconds, args.think)  # fmt: skip
        kv_before = asyncio.run(run(soak))
        ledger = pg.ledger()
        spent = pg.tenant_tokens()
        counters = {name: redis.daily_tokens(NAMESPACE, tid) for name, (tid, _) in spent.items()}
        held = redis.held_reservations(NAMESPACE)
        t_stop = time.monotonic()
        stop()
        stop = None
        shutdown_s = time.monotonic() - t_stop
        after_stop = pg.ledger()
    finally:
        if stop is not None:
            stop()
        for fn in reversed(cleanups):
            try:
                fn()
            except Exception as exc:  # cleanup is best effort
                say(f"cleanup: {type(exc).__name__}: {exc}")

    samples = soak.samples
    base, end = growth(samples, warmup_s)
    kv_after = samples[-1].kv_used if samples[-1].kv_used is not None else -1
    v = verdict(samples, warmup_s, soak.calls, soak.outage, ledger, kv_before, kv_after)
    table(samples, base, end)
    report_calls(soak)
    violations = policy_check(soak)
    outage_check(soak)
    aborted = sum(1 for _, status, _ in ledger.rows.values() if status == "aborted")
    print(f"ledger: {len(ledger.rows)} rows for {v.expected_rows} requests answered 200; lost {v.lost_rows}, "
          f"duplicate rows {v.duplicate_rows}, ids answered twice {v.duplicate_ids}, rows never answered 200 "
          f"{v.unexpected_rows}; {aborted} rows aborted; {len(after_stop.rows) - len(ledger.rows)} more rows after "
          f"the gateway stopped")  # fmt: skip
    if v.lost_examples:
        say(f"  lost: {', '.join(v.lost_examples)}")
    print(f"soak-tight spent {spent['soak-tight'][1]} tokens of its {TIGHT_TOKENS}-token budget")
    counted = ", ".join(
        f"{name} {counters[name][0]} (ledger {tokens})" + (" over two days" if counters[name][1] > 1 else "")
        for name, (_, tokens) in sorted(spent.items())
        if name != "soak-admin"
    )
    print(f"daily token counters in Redis once idle: {counted}; reservations still held: {held}")
    print(log_summary(log))
    print(f"KV blocks in use: {kv_before} idle before the load, {kv_after} idle after; gateway stopped in "
          f"{shutdown_s:.1f}s (exit {proc.returncode}); gateway log {log}")  # fmt: skip
    print(f"RSS {base.rss_mb:.1f} MB at {base.t / 60:.1f} min → {end.rss_mb:.1f} MB at {end.t / 60:.1f} min; "
          f"fds {base.fds} → {end.fds}; policy cap violations {violations}")  # fmt: skip
    plot(samples, soak, warmup_s, args.plot)
    print(json.dumps({
        "minutes": args.minutes,
        "rss_growth_pct": round(v.rss_growth_pct, 2),
        "fd_growth": v.fd_growth,
        "lost_rows": v.lost_rows,
        "unexpected_5xx": v.unexpected_5xx,
        "kv_blocks_leaked": v.kv_blocks_leaked,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
