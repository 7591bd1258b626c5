"""`bench.savings`' live gateway: the `switchboard serve` process, its router, the tenants and their
policies, and the replay of a trace through HTTP with bursty arrivals and bounded concurrency.

The gateway runs as a subprocess (as `bench.load` starts it) on a fresh PostgreSQL database and a Redis
namespace of its own (`tests/services.py`: 127.0.0.1:5432 db `test` and 6379, or throwaway servers), or
with `embedded=True` on SQLite and in-process counters. Profile `default` serves the configured Qwen pair;
`tiny` serves SmolLM2-135M as both `small` and `large` (the tiny profile alone has one tier, and the
always-large run needs a `large`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import from_tests
from bench.load import say
from bench.savings_trace import Request
from bench.serve import SERVE, far_limits, launch_serve, serve_env

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = "smollm2-135m-instruct"
ROLES = ("saver", "balanced", "quality")
LARGE_SHARES = {"saver": 0.1, "balanced": 0.3, "quality": 0.6}  # each tenant's router calibration target


# --- the router ----------------------------------------------------------------------------------------


def prepare_router(router: Path | None, profile: str, home: Path, out: Path) -> Path:
    """A router the gateway can load: `router` if given; for the default profile home/router if it loads;
    else one trained here (tiny: on 200 synthetic labels, seconds; default: on the shipped labels, minutes)."""
    from router_model.model import RouterLoadError, load_router

    if router is not None or profile == "default":
        directory = (router or home / "router").expanduser()
        try:
            load_router(directory)
            return directory
        except (RouterLoadError, FileNotFoundError, OSError) as exc:
            if router is not None:
                raise SystemExit(f"--router {router}: {exc}") from None
            say(f"no usable router at {directory} ({exc}); training one for this run")
    from router_model.encoder import RouterEncoder
    from router_model.model import save_router
    from router_model.synthetic import synthetic_examples, write_label_file
    from router_model.train import train_from_labels

    out.mkdir(parents=True, exist_ok=True)
    if profile == "tiny":
        labels = write_label_file(synthetic_examples(200, seed=1), out / "router-labels.jsonl")
        result = train_from_labels(labels, RouterEncoder(), home=home, folds=2, candidates=("hist_gb",))
    else:
        from router_model.label import SHIPPED_LABELS as labels

        result = train_from_labels(labels, RouterEncoder(), home=home)
    return save_router(result.router, out / "router")


# --- tenants and policies ------------------------------------------------------------------------------


def auto_policies(thresholds: dict[str, float], cap: int) -> dict[str, Any]:
    """The three tenants of the `auto` run: a cost-saver (few large calls, semantic cache, a max_tokens cap),
    a balanced default, a quality-first one (more large calls, prompt-example checks with a cascade). No
    shadow runs, and checks only where named: the run as it was before those became the default."""
    from policies.policy import CacheSettings, Policy, RouterSettings, SamplingLimits, VerifierSettings

    def router(role: str) -> RouterSettings:
        return RouterSettings(mode="threshold", threshold=thresholds[role], shadow_share=0.0)

    verifiers = VerifierSettings(enabled=["degeneration"], checks=["prompt_examples"], cascade=True)
    return {
        "saver": Policy(router=router("saver"), cache=CacheSettings(semantic=True),
                        sampling=SamplingLimits(max_tokens_cap=cap), verifiers=_no_checks(), **far_limits()),
        "balanced": Policy(router=router("balanced"), cache=CacheSettings(semantic=False), verifiers=_no_checks(),
                           **far_limits()),
        "quality": Policy(router=router("quality"), cache=CacheSettings(semantic=False), verifiers=verifiers,
                          **far_limits()),
    }  # fmt: skip


def default_policy(shadow_share: float | None = None) -> Any:
    """The `default` run's tenants: the built-in default policy (a 0.95 quality floor, the semantic cache,
    shadow runs, code checks with a cascade), with only the bench's far-off budgets and rate limits added;
    `shadow_share` replaces the default's to measure the estimate on more verdicts."""
    from policies.policy import Policy, RouterSettings

    router = RouterSettings() if shadow_share is None else RouterSettings(shadow_share=shadow_share)
    return Policy(router=router, **far_limits())


def _no_checks() -> Any:
    from policies.policy import VerifierSettings

    return VerifierSettings(checks=[], cascade=False)


def large_policy() -> Any:
    """The always-large run's tenants: no cache (the requests also say `no-store`), no router, no checks."""
    from policies.policy import CacheSettings, Policy

    return Policy(cache=CacheSettings(enabled=False), verifiers=_no_checks(), **far_limits())


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str
    run: str  # large | auto | default | learned | judge
    role: str  # saver | balanced | quality | judge
    policy: Any  # policies.policy.Policy


def create_tenants(
    db_url: str, auto: dict[str, Any], shadow_share: float | None = None
) -> tuple[dict[tuple[str, str], Tenant], str, str]:
    """Tenants for each run and role (the default and learned runs' alike: the built-in default policy), a
    judge tenant, and the operator's finance and admin keys."""
    from core.db.database import Database
    from gateway.accounting.tenants import create_tenant, tenant_by_name
    from policies.policy import Policy
    from policies.store import PolicyStore

    db = Database(db_url)
    suffix = uuid.uuid4().hex[:6]
    plan = [("large", role, large_policy()) for role in ROLES]
    plan += [("auto", role, auto[role]) for role in ROLES]
    plan += [(run, role, default_policy(shadow_share)) for run in ("default", "learned") for role in ROLES]
    plan += [("judge", "judge", Policy(verifiers=_no_checks(), **far_limits()))]
    tenants = {}
    try:
        for run, role, policy in plan:
            name = f"savings-{run}-{role}-{suffix}"
            key = create_tenant(db, name, actor="bench").key
            found = tenant_by_name(db, name)
            assert found is not None
            PolicyStore(db).save(found.id, policy, "bench", note="bench/savings.py")
            tenants[(run, role)] = Tenant(name, key, run, role, policy)
        ops = create_tenant(db, f"savings-ops-{suffix}", operator=True, role="finance", actor="bench").key
        admin = create_tenant(db, f"savings-admin-{suffix}", operator=True, role="admin", actor="bench").key
    finally:
        db.dispose()
    return tenants, ops, admin


# --- the gateway process -------------------------------------------------------------------------------


@dataclass
class Served:
    url: str
    db_url: str
    log: Path
    stop: Callable[[], None]


def _database(embedded: bool, tmp: str, cleanups: list[Callable[[], None]]) -> tuple[str, dict[str, str]]:
    """The database URL and the Redis settings (none when embedded)."""
    if embedded:
        return f"sqlite:///{tmp}/switchboard.db", {}
    services = from_tests("services")
    db_url, drop = services.create_database(services.postgres_url())
    cleanups.append(drop)
    redis_url, namespace = services.redis_url(), f"sbbench-savings-{uuid.uuid4().hex[:8]}"
    cleanups.append(lambda: services.delete_namespace(redis_url, namespace))
    cleanups.append(services.stop_all)
    return db_url, {"SWITCHBOARD_REDIS_URL": redis_url, "SWITCHBOARD_REDIS_NAMESPACE": namespace}


def _tier_env(profile: str, threads: int) -> dict[str, str]:
    if profile == "default":
        return {"SWITCHBOARD_PROFILE": "default"}
    tier = {"model": TINY_MODEL, "threads": threads}
    return {"SWITCHBOARD_TIERS": json.dumps({"small": tier, "large": tier}), "SWITCHBOARD_KV_POOL_BYTES": "256MiB"}


def start_gateway(home: Path, profile: str, router_dir: Path, embedded: bool, log: Path, threads: int) -> Served:
    """`switchboard serve` in a subprocess on a fresh database; healthy when this returns."""
    from core.db.database import Database
    from gateway.accounting.tenants import use_key_secret

    cleanups: list[Callable[[], None]] = []
    tmp = tempfile.TemporaryDirectory(prefix="sb-bench-savings-")
    cleanups.append(tmp.cleanup)
    db_url, redis_env = _database(embedded, tmp.name, cleanups)
    Database(db_url).upgrade()
    secret = secrets.token_hex(24)  # keys made here authenticate there
    os.environ["SWITCHBOARD_KEY_SECRET"] = secret
    use_key_secret(secret, home)
    port = from_tests("services").free_port()
    env = serve_env(home, db_url, port, **redis_env, **_tier_env(profile, threads),
                    SWITCHBOARD_CONFIG="/nonexistent/switchboard.toml", SWITCHBOARD_ROUTER_DIR=str(router_dir),
                    OMP_NUM_THREADS=str(threads))  # fmt: skip
    _, url, stop = launch_serve(SERVE, env, tmp.name, port, log, cleanups, ready_s=900, poll_s=0.5)
    return Served(url, db_url, log, stop)


def offers_auto(url: str, key: str) -> bool:
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    return r.status_code == 200 and any(m["id"] == "auto" for m in r.json()["data"])


# --- the replay ----------------------------------------------------------------------------------------


def outcome(request: Request, r: httpx.Response | None, error: str | None, ms: float) -> dict[str, Any]:
    """One request's record: what the gateway answered, by which tier, from the cache or not, and its usage."""
    row: dict[str, Any] = {"index": request.index, "tenant": request.tenant, "ms": round(ms, 1), "ok": False,
                           "status": None if r is None else r.status_code, "error": error, "text": None}  # fmt: skip
    if r is None:
        return row
    h = r.headers
    row |= {"request_id": h.get("x-request-id"), "tier": h.get("x-switchboard-tier"),
            "cache": h.get("x-switchboard-cache"), "p_small": h.get("x-switchboard-route-p-small"),
            "cascade": h.get("x-switchboard-cascade")}  # fmt: skip
    try:
        body = r.json()
    except ValueError:
        row["error"] = f"HTTP {r.status_code}: not JSON: {r.text[:200]!r}"
        return row
    if r.status_code != 200:
        row["error"] = f"HTTP {r.status_code}: {json.dumps(body.get('error', body))[:300]}"
        return row
    usage = body.get("usage") or {}
    row |= {"ok": True, "text": body["choices"][0]["message"]["content"] or ""}
    row |= {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens")}
    return row


async def replay(
    url: str, trace: Sequence[Request], keys: dict[str, str], *, model: str, no_store: bool, concurrency: int,
    time_scale: float, timeout: float, record: Path, desc: str, append: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every request at its arrival time (scaled; 0: all due at once), at most `concurrency` in flight; a
    request that fails is recorded with its error, never raised. Records go to `record` (added to it with
    `append`) as they finish; the returned list is in `trace`'s order (a part of a trace replays too)."""
    from tqdm import tqdm

    gate = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any]] = [{} for _ in trace]
    bar = tqdm(total=len(trace), desc=desc, file=sys.stderr, unit="req")
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        start = time.perf_counter()

        async def one(position: int, request: Request, sink: Any) -> None:
            if (wait := start + request.at * time_scale - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            body = {"model": model, "messages": request.messages, "max_tokens": request.max_tokens, "temperature": 0}
            if no_store:
                body["cache"] = "no-store"
            headers = {"Authorization": f"Bearer {keys[request.tenant]}"}
            async with gate:
                t0 = time.perf_counter()
                try:
                    r = await http.post("/v1/chat/completions", json=body, headers=headers)
                    row = outcome(request, r, None, 1000 * (time.perf_counter() - t0))
                except (httpx.HTTPError, OSError) as exc:
                    row = outcome(request, None, f"{type(exc).__name__}: {exc}", 1000 * (time.perf_counter() - t0))
            results[position] = row
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            bar.update(1)
            bar.set_postfix(failed=sum(1 for x in results if x and not x["ok"]))

        with record.open("a" if append else "w") as sink:
            await asyncio.gather(*(one(i, r, sink) for i, r in enumerate(trace)))
    bar.close()
    return results


async def ask_large(url: str, key: str, conversations: list[list[dict[str, str]]], max_tokens: int,
                    concurrency: int, timeout: float) -> list[str | None]:  # fmt: skip
    """Greedy answers of the `large` tier (the judge), None for a request that failed."""
    from tqdm import tqdm

    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(conversations), desc="judge", file=sys.stderr, unit="req")
    async with httpx.AsyncClient(base_url=url, timeout=timeout, headers={"Authorization": f"Bearer {key}"}) as http:

        async def one(messages: list[dict[str, str]]) -> str | None:
            body = {"model": "large", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            async with gate:
                try:
                    r = await http.post("/v1/chat/completions", json=body)
                    answer = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
                except (httpx.HTTPError, OSError, ValueError, KeyError):
                    answer = None
            bar.update(1)
            return answer

        out = await asyncio.gather(*(one(c) for c in conversations))
    bar.close()
    return list(out)


# --- what the gateway recorded -------------------------------------------------------------------------


def route_histogram(url: str) -> dict[str, float]:
    """`switchboard_route_seconds` from /metrics: cumulative counts by upper bound ("+Inf" too), and `_sum`."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for le, value in re.findall(r'^switchboard_route_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M):
        out[le] = float(value)
    if m := re.search(r"^switchboard_route_seconds_sum (\S+)$", text, re.M):
        out["sum"] = float(m.group(1))
    return out


def histogram_p50_ms(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The median of the decisions between two scrapes, linear within its bucket; None if there were none."""
    bounds = sorted((float(le), after[le] - before.get(le, 0.0)) for le in after if le not in ("sum", "+Inf"))
    total = after.get("+Inf", 0.0) - before.get("+Inf", 0.0)
    if total <= 0:
        return None
    lower, below = 0.0, 0.0
    for upper, cumulative in bounds:
        if cumulative >= total / 2:
            inside = cumulative - below
            frac = (total / 2 - below) / inside if inside else 1.0
            return round(1000 * (lower + frac * (upper - lower)), 2)
        lower, below = upper, cumulative
    return round(1000 * lower, 2)  # past the last finite bound: report that bound


def settle_ledger(db_url: str, tenants: Sequence[str], expected: int, wait_s: float = 120.0) -> int:
    """Wait until the tenants' ledger rows stop changing (and number at least `expected`); their count."""
    import sqlalchemy as sa

    from core.db.database import Database
    from core.db.models import Tenant as TenantRow
    from core.db.models import Usage

    db = Database(db_url)
    q = sa.select(sa.func.count()).select_from(Usage).join(TenantRow, TenantRow.id == Usage.tenant_id)
    q = q.where(TenantRow.name.in_(list(tenants)))
    last, stable_since, deadline = -1, time.monotonic(), time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            with db.session() as s:
                count = int(s.scalar(q) or 0)
            if count != last:
                last, stable_since = count, time.monotonic()
            elif count >= expected and time.monotonic() - stable_since > 2:
                break
            time.sleep(0.5)
    finally:
        db.dispose()
    return last


def dig(found: Any, *keys: str) -> Any:
    """`found[k1][k2]...`, None where a level is missing or not a mapping (a gateway without that field)."""
    for key in keys:
        if not isinstance(found, dict):
            return None
        found = found.get(key)
    return found


def settle_router(url: str, admin_key: str, tenants: dict[str, str], probe: Callable[[dict[str, Any]], Any],
                  wait_s: float, quiet_s: float = 15.0) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Poll `GET /v1/admin/router` until `probe` of every tenant's entry has not changed for `quiet_s` (at most
    `wait_s`): the background runs behind the replay (shadow runs, explore runs) have settled. Role → that
    tenant's last entry ({} where the gateway lists none). `tenants`: role → tenant name."""

    def read() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        r = httpx.get(f"{url}/v1/admin/router", headers={"Authorization": f"Bearer {admin_key}"}, timeout=60)
        r.raise_for_status()
        stats = r.json().get("tenants") or {}
        entries = {role: stats.get(name) or {} for role, name in tenants.items()}
        return entries, {role: probe(e) for role, e in entries.items()}

    (entries, last), stable_since, deadline = read(), time.monotonic(), time.monotonic() + wait_s
    while time.monotonic() < deadline and time.monotonic() - stable_since < quiet_s:
        time.sleep(1.0)
        entries, now = read()
        if now != last:
            last, stable_since = now, time.monotonic()
    return entries


def quality_estimates(url: str, admin_key: str, tenants: dict[str, str], wait_s: float = 600.0) -> dict[str, Any]:
    """Per role, the gateway's quality estimate for that tenant (`GET /v1/admin/router`), once its shadow
    runs stop adding verdicts (they run behind live requests, after the replay): role → the estimate (None
    without a verdict). `tenants`: role → tenant name."""
    entries = settle_router(url, admin_key, tenants, lambda e: dig(e, "quality", "estimate"), wait_s)
    return {role: dig(e, "quality", "estimate") for role, e in entries.items()}
