"""The ledger's group-commit writer and its spool, on SQLite and the local PostgreSQL."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from decimal import Decimal as D
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy as sa

from core.db.database import Database
from core.db.models import Usage, UsageDaily
from gateway.accounting.ledger import Ledger, UsageRecord, rebuild_rollup
from gateway.accounting.tenants import authenticate, create_tenant

DOWN = "postgresql+psycopg://postgres@127.0.0.1:1/none?connect_timeout=1"


def _rec(tenant: int, rid: str, cost: str = "0.0000000007", tier: str = "small") -> UsageRecord:
    return UsageRecord.from_columns(
        rid, tenant, None, "chat.completions", "m", tier, 3, 4, 5, "ok", "stop", cost=D(cost)
    )


def _rows(db: Database) -> list[str]:
    with db.session() as s:
        return sorted(s.scalars(sa.select(Usage.request_id)))


def _rollup(db: Database) -> list[tuple]:
    with db.session() as s:
        return sorted(s.execute(sa.select(UsageDaily.tier, UsageDaily.requests, UsageDaily.cost)).tuples())


def test_concurrent_writes_share_transactions_and_the_rollup_stays_exact(database: Database, tmp_path: Path) -> None:
    tenant = authenticate(database, create_tenant(database, "acme").key).tenant_id  # type: ignore[union-attr]
    ledger = Ledger(database, tmp_path / "spool.jsonl")
    commits = 0
    commit = ledger._commit

    def counting(recs: list[UsageRecord]) -> list:
        nonlocal commits
        commits += 1
        return commit(recs)

    ledger._commit = counting  # type: ignore[method-assign]

    async def main() -> None:
        await asyncio.gather(*(ledger.write(_rec(tenant, f"r{i}", tier=("small", "large")[i % 2])) for i in range(300)))
        await ledger.aclose()

    asyncio.run(main())
    assert _rows(database) == sorted(f"r{i}" for i in range(300))
    assert 1 <= commits < 30  # rows that arrived together went in together
    assert _rollup(database) == [("large", 150, D("0.000000105")), ("small", 150, D("0.000000105"))]
    rebuild_rollup(database)
    assert _rollup(database) == [("large", 150, D("0.000000105")), ("small", 150, D("0.000000105"))]


def test_a_stored_request_id_fails_alone(database: Database, tmp_path: Path) -> None:
    tenant = authenticate(database, create_tenant(database, "acme").key).tenant_id  # type: ignore[union-attr]
    ledger = Ledger(database, tmp_path / "spool.jsonl")
    ledger.record(_rec(tenant, "dup"))

    async def main() -> list:
        try:
            return await asyncio.gather(
                *(ledger.write(_rec(tenant, rid)) for rid in ("a", "dup", "b")), return_exceptions=True
            )
        finally:
            await ledger.aclose()

    results = asyncio.run(main())
    assert results[0] is None and results[2] is None and isinstance(results[1], sa.exc.IntegrityError)
    assert _rows(database) == ["a", "b", "dup"]
    assert _rollup(database) == [("small", 3, D("0.0000000021"))]


def test_waiting_for_usage_fails_on_a_request_billed_twice(sqlite_url: str, tmp_path: Path) -> None:
    """tests/live.py's `wait_for_usage` can fail: a second billing of a request leaves one row (the ledger
    refuses it), and the wait sees the second write; a request billed once comes back after the settle."""
    from fastapi import FastAPI

    from live import SETTLE_SECONDS, LiveServer

    db = Database(sqlite_url)
    db.upgrade()
    tenant = authenticate(db, create_tenant(db, "acme").key).tenant_id  # type: ignore[union-attr]
    ledger = Ledger(db, tmp_path / "spool.jsonl")
    app = FastAPI()
    app.state.services = SimpleNamespace(pipeline=SimpleNamespace(ledger=ledger))  # what the hook reads
    live = LiveServer("http://127.0.0.1:1", db, app)
    live.count_ledger_writes()

    async def main() -> None:
        await ledger.write(_rec(tenant, "once"))
        await ledger.write(_rec(tenant, "twice"))
        with pytest.raises(sa.exc.IntegrityError):
            await ledger.write(_rec(tenant, "twice"))
        await ledger.aclose()

    asyncio.run(main())
    assert _rows(db) == ["once", "twice"] and live.ledger_writes == {"once": 1, "twice": 2}
    (row,) = live.wait_for_usage("once")
    stored = row.created_at.replace(tzinfo=UTC)  # SQLite's timestamps come back without their zone
    assert (datetime.now(UTC) - stored).total_seconds() >= SETTLE_SECONDS
    with pytest.raises(AssertionError, match="billed twice"):
        live.wait_for_usage("twice")
    assert live.wait_for_usage("never", timeout=0.2) == []
    db.dispose()


def test_rows_spooled_while_the_database_is_down_drain_in_the_background(database: Database, tmp_path: Path) -> None:
    tenant = authenticate(database, create_tenant(database, "acme").key).tenant_id  # type: ignore[union-attr]
    down = Database(DOWN)
    ledger = Ledger(down, tmp_path / "spool.jsonl")
    ledger.DRAIN_EVERY = (0.2, 0.5)

    async def main() -> None:
        await asyncio.gather(*(ledger.write(_rec(tenant, f"s{i}")) for i in range(20)))  # returns: spooled
        assert ledger.spool and _rows(database) == []
        ledger.db = database  # the database is back; no new request arrives
        for _ in range(100):
            if not ledger.spool:
                break
            await asyncio.sleep(0.1)
        await ledger.write(_rec(tenant, "after"))
        await ledger.aclose()

    asyncio.run(main())
    down.dispose()
    assert not ledger.spool.path.exists()
    assert _rows(database) == sorted([*(f"s{i}" for i in range(20)), "after"])
    assert _rollup(database) == [("small", 21, D("0.0000000147"))]
    # a replay of an already-written spool (a crash between commit and unlink) adds nothing
    ledger.spool.append([_rec(tenant, "s0").to_json(), _rec(tenant, "new").to_json()])
    assert ledger.replay_spool() == 2
    assert _rows(database).count("s0") == 1 and "new" in _rows(database)
    assert _rollup(database) == [("small", 22, D("0.0000000154"))]


def test_processes_appending_while_another_drains_lose_and_repeat_nothing(database: Database, tmp_path: Path) -> None:
    tenant = authenticate(database, create_tenant(database, "acme").key).tenant_id  # type: ignore[union-attr]
    spool = tmp_path / "spool.jsonl"
    writer = textwrap.dedent(f"""
        import sys
        from gateway.accounting.ledger import UsageRecord
        from gateway.accounting.spool import UsageSpool
        spool = UsageSpool(__import__("pathlib").Path({str(spool)!r}))
        for i in range(150):
            rid = f"{{sys.argv[1]}}{{i}}"
            rec = UsageRecord.from_columns(rid, {tenant}, None, "completions", "m", "small", 1, 1, 1, "ok", "stop")
            spool.append([rec.to_json()])
    """)
    procs = [subprocess.Popen([sys.executable, "-c", writer, p]) for p in ("p", "q")]
    ledger = Ledger(database, spool)
    while any(p.poll() is None for p in procs):
        ledger.replay_spool()
    assert all(p.returncode == 0 for p in procs)
    ledger.replay_spool()
    rows = _rows(database)
    assert len(rows) == 300 and set(rows) == {f"{p}{i}" for p in "pq" for i in range(150)}
    assert _rollup(database) == [("small", 300, D(0))]


@pytest.mark.parametrize("closing", [True, False])
def test_a_cancelled_caller_still_gets_its_row_written(database: Database, tmp_path: Path, closing: bool) -> None:
    tenant = authenticate(database, create_tenant(database, "acme").key).tenant_id  # type: ignore[union-attr]
    ledger = Ledger(database, tmp_path / "spool.jsonl")

    async def main() -> None:
        task = asyncio.create_task(ledger.write(_rec(tenant, "gone")))
        await asyncio.sleep(0)
        task.cancel()
        if closing:
            await ledger.aclose()
        else:
            await ledger.write(_rec(tenant, "next"))
            await ledger.aclose()

    asyncio.run(main())
    assert "gone" in _rows(database)
