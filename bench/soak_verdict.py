"""`bench.soak`'s verdict on what the client saw: each request as the client saw it (`Call`), the Redis
outage (`Window`), the samples (`Sample`), the ledger rows (`Ledger`), and what the soak concludes from them:
the answer each request should get (`judge`), the 5xx nothing excuses, growth from the end of the warm-up to
the end of the load, and ledger rows lost or unexpected (`verdict`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BAD_CASES",
    "LIMITED",
    "OUTAGE_GRACE_S",
    "Call",
    "Ledger",
    "Sample",
    "Verdict",
    "Window",
    "expected_status",
    "growth",
    "judge",
    "unexpected_5xx",
    "verdict",
]

OUTAGE_GRACE_S = 10.0  # 503 budget_unavailable is expected until this long after Redis is back
LIMITED = {"soak-main", "soak-tight"}  # tenants whose policy has limits: fail closed while Redis is down

# name → (body: a JSON-able object, or raw bytes; headers beyond the key; whether to send the key; status)
HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
BAD_CASES: dict[str, tuple[Any, dict[str, str], bool, int]] = {
    "malformed_json": (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"', {}, True, 400),
    "refused_field": ({"model": "tiny", "messages": HI, "tools": TOOLS}, {}, True, 400),
    "logprobs": ({"model": "tiny", "messages": HI, "logprobs": True}, {}, True, 400),
    "wrong_type": ({"model": "tiny", "messages": HI, "max_tokens": "ten"}, {}, True, 400),
    "unknown_model": ({"model": "huge", "messages": HI}, {}, True, 404),
    "no_key": ({"model": "tiny", "messages": HI}, {}, False, 401),
    "content_type": (b'{"model": "tiny", "messages": []}', {"content-type": "text/plain"}, True, 400),
}


@dataclass
class Call:
    """One request as the client saw it."""

    kind: str  # hit | stream | cancel | completion | bad:<case> | budget
    tenant: str
    t0: float  # seconds since the load began
    t1: float
    status: int  # HTTP status; 0: no answer (transport error)
    code: str = ""  # the error body's code (or type)
    request_id: str | None = None  # a 200's id: the ledger row it must have
    cache: str = ""  # x-switchboard-cache
    completion_tokens: int | None = None  # where the answer said (usage)
    stream_error: str = ""  # a 200 stream that broke: an error event, no [DONE], no usage chunk where asked
    note: str = ""


@dataclass(frozen=True)
class Window:
    """The Redis outage: killed at `start`, answering again at `end` (seconds since the load began)."""

    start: float
    end: float


def expected_status(kind: str) -> set[int]:
    if kind.startswith("bad:"):
        return {BAD_CASES[kind[4:]][3]}
    if kind == "budget":
        return {200, 429}
    return {200}


def judge(call: Call, outage: Window | None) -> str:
    """ok (as expected), outage (a 503 `budget_unavailable` the Redis outage excuses), transport (no answer),
    stream_error (a 200 stream that broke) or unexpected."""
    if call.status == 0:
        return "transport"
    refused = call.status == 503 and call.code == "budget_unavailable" and call.tenant in LIMITED
    if refused and outage is not None and outage.start <= call.t1 and call.t0 <= outage.end + OUTAGE_GRACE_S:
        return "outage"
    if call.status not in expected_status(call.kind):
        return "unexpected"
    if call.status == 429 and call.code != "insufficient_quota":
        return "unexpected"
    if call.stream_error:
        return "stream_error"
    return "ok"


def unexpected_5xx(calls: list[Call], outage: Window | None) -> int:
    """5xx answers nothing excuses, and 200 streams that carried an error event (the server's failure too)."""
    n = 0
    for c in calls:
        verdict = judge(c, outage)
        server_error = verdict == "unexpected" and c.status >= 500
        n += server_error or (verdict == "stream_error" and c.stream_error.startswith("error event"))
    return n


# --- samples ----------------------------------------------------------------------------------------


@dataclass
class Sample:
    t: float  # seconds since the load began
    phase: str  # idle | load | outage | idle-after
    rss_mb: float
    fds: int
    cpu_pct: float  # the gateway's CPU since the previous sample, % of one core
    pg_conns: int | None
    kv_used: int | None  # blocks referenced by a sequence, all tiers
    kv_cached: int | None  # blocks in the prefix cache (referenced or not)
    running: int | None  # sequences running or waiting, all tiers
    redis_keys: int | None
    requests: int  # answered so far
    bad_5xx: int  # unexpected 5xx so far


def growth(samples: list[Sample], warmup_s: float) -> tuple[Sample, Sample]:
    """(the first load sample at or past the warm-up, the last load sample): what growth is measured between."""
    load = [s for s in samples if s.phase in ("load", "outage")]
    if not load:
        raise ValueError("no samples under load")
    base = next((s for s in load if s.t >= warmup_s), load[-1])
    return base, load[-1]


@dataclass
class Ledger:
    rows: dict[str, tuple[str, str, str]]  # request id → (tenant, status, cache status)
    duplicates: int  # rows beyond the first for one request id (the primary key forbids them)


@dataclass
class Verdict:
    rss_growth_pct: float
    fd_growth: int
    expected_rows: int
    lost_rows: int
    duplicate_ids: int  # one request id answered twice (client side)
    duplicate_rows: int
    unexpected_rows: int  # rows for requests the client never saw answered 200
    unexpected_5xx: int
    kv_blocks_leaked: int
    lost_examples: list[str] = field(default_factory=list)


def verdict(
    samples: list[Sample],
    warmup_s: float,
    calls: list[Call],
    outage: Window | None,
    ledger: Ledger,
    kv_idle_before: int,
    kv_idle_after: int,
) -> Verdict:
    base, end = growth(samples, warmup_s)
    ids = [c.request_id for c in calls if c.status == 200 and c.request_id]
    want = set(ids)
    lost = sorted(want - set(ledger.rows))
    return Verdict(
        rss_growth_pct=(end.rss_mb - base.rss_mb) / base.rss_mb * 100 if base.rss_mb else 0.0,
        fd_growth=end.fds - base.fds,
        expected_rows=len(want),
        lost_rows=len(lost),
        duplicate_ids=len(ids) - len(want),
        duplicate_rows=ledger.duplicates,
        unexpected_rows=len(set(ledger.rows) - want),
        unexpected_5xx=unexpected_5xx(calls, outage),
        kv_blocks_leaked=kv_idle_after - kv_idle_before,
        lost_examples=lost[:5],
    )
