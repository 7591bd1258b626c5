"""The ledger: exactly one priced usage row per request that ran, and its daily rollup.

The request id is the primary key, so a second row for a request cannot exist. The row and its
rollup increment commit in one transaction, so the rollup always equals the sum of the raw rows and
reports never scan them. If the database is unreachable the row goes to a spool file under the home
directory, drained (rollup included) as soon as the database answers again: usage is never dropped.
The row itself is `gateway.accounting.record.UsageRecord`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
from sqlalchemy import func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db.database import Database
from core.db.models import Usage, UsageDaily
from gateway.accounting.record import AMOUNTS, COUNTS, UsageRecord
from gateway.accounting.spool import UsageSpool

__all__ = ["AMOUNTS", "COUNTS", "Ledger", "UsageRecord", "add", "add_many", "rebuild_rollup", "spool_path"]

log = logging.getLogger(__name__)

_UPSERTS: dict[str, Any] = {}


def _rollup_upsert(dialect: str) -> Any:
    """INSERT … ON CONFLICT DO UPDATE adding every count and amount; built once per dialect, since
    building it costs more than running it."""
    if dialect not in _UPSERTS:
        table = UsageDaily.__table__
        stmt = (postgresql if dialect == "postgresql" else sqlite).insert(table)
        added = ("requests", *COUNTS, *AMOUNTS)
        _UPSERTS[dialect] = stmt.on_conflict_do_update(
            index_elements=["tenant_id", "day", "tier", "model"],
            set_={k: table.c[k] + stmt.excluded[k] for k in added},
        )
    return _UPSERTS[dialect]


# On the table, not the mapped class: through the session's connection these skip the ORM's bulk-insert
# machinery, which cost the ledger thread (holding the GIL) as much again as the insert itself.
_INSERT_USAGE = insert(Usage.__table__)


def add(session: Session, rec: UsageRecord) -> None:
    """One usage row and its rollup increment, in the caller's transaction."""
    add_many(session, [rec])


def add_many(session: Session, recs: list[UsageRecord]) -> None:
    """Usage rows and their rollup increments, in the caller's transaction: one executemany insert and
    one upsert per (tenant, day, tier, model), in key order so concurrent replicas lock rollup rows in
    the same order (no deadlocks). Core statements: the ORM's unit of work doubles the time."""
    rows = [r.as_row() for r in recs]
    conn = session.connection()
    conn.execute(_INSERT_USAGE, rows)  # a duplicate request id fails here, before the rollup is touched
    sums: dict[tuple, dict[str, Any]] = {}
    for rec, row in zip(recs, rows, strict=True):
        key = (rec.tenant_id, rec.created_at.date(), rec.tier, rec.model)
        if (acc := sums.get(key)) is None:
            day = {"tenant_id": rec.tenant_id, "day": key[1], "tier": rec.tier, "model": rec.model}
            sums[key] = {**day, "requests": 1, **{k: row[k] for k in (*COUNTS, *AMOUNTS)}}
        else:
            acc["requests"] += 1
            for k in (*COUNTS, *AMOUNTS):
                acc[k] += row[k]
    upsert = _rollup_upsert(session.bind.dialect.name)  # type: ignore[union-attr]
    for key in sorted(sums):
        conn.execute(upsert, sums[key])


def spool_path(home: Path, database_url: str) -> Path:
    """One spool per database: rows spooled for one deployment never land in another's database."""
    return home / f"usage-spool-{hashlib.sha256(database_url.encode()).hexdigest()[:12]}.jsonl"


class Ledger:
    """Writes usage rows. `write` (the request path) group-commits: rows that arrive while a commit runs
    go together in the next transaction, one thread hop per batch, and each caller returns once its row
    is committed or spooled. When the database is down rows go to the spool (fsynced), which is
    drained in the background as soon as it answers again, and on every start."""

    MAX_BATCH = 512
    DRAIN_EVERY = (1.0, 10.0)  # seconds between drain attempts while the spool has rows: first, most

    def __init__(self, db: Database, spool: Path) -> None:
        self.db = db
        self.spool = UsageSpool(spool)
        self._pending: list[tuple[UsageRecord, asyncio.Future[None]]] = []
        self._wake: asyncio.Event | None = None
        self._writer: asyncio.Task[None] | None = None
        self._closing = False
        self._drain_wait = self.DRAIN_EVERY[0]
        self._next_drain = 0.0

    # --- the request path ---------------------------------------------------------------------------

    async def write(self, rec: UsageRecord) -> None:
        """Commit `rec` (or spool it if the database is down). Cancelling the caller does not cancel
        the write. Raises IntegrityError for a request id that is already stored."""
        loop = asyncio.get_running_loop()
        if self._writer is None or self._writer.done():
            self._wake = asyncio.Event()
            self._writer = loop.create_task(self._run(), name="ledger-writer")
        done = loop.create_future()
        self._pending.append((rec, done))
        assert self._wake is not None
        self._wake.set()
        await asyncio.shield(done)

    async def aclose(self) -> None:
        """Write what is queued, try the spool once more, stop the writer."""
        self._closing = True
        if self._writer is not None and not self._writer.done():
            assert self._wake is not None
            self._wake.set()
            await self._writer

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if not self._pending:
                if self._closing:
                    await anyio.to_thread.run_sync(self._drain_quietly)
                    return
                self._wake.clear()
                timeout = max(0.0, self._next_drain - time.monotonic()) if self.spool else None
                with contextlib.suppress(TimeoutError):  # time to retry the spool
                    await asyncio.wait_for(self._wake.wait(), timeout)
            batch, self._pending = self._pending[: self.MAX_BATCH], self._pending[self.MAX_BATCH :]
            if batch:
                try:
                    errors = await anyio.to_thread.run_sync(self._commit, [r for r, _ in batch])
                except BaseException as exc:  # the writer must outlive anything one batch does
                    errors = [exc] * len(batch)
                for (_, done), error in zip(batch, errors, strict=True):
                    if done.done():
                        continue
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(error)
            if self.spool and time.monotonic() >= self._next_drain:
                await anyio.to_thread.run_sync(self._drain_quietly)

    def _commit(self, recs: list[UsageRecord]) -> list[BaseException | None]:
        """One transaction for the batch; per-row ones only if some request id is already stored."""
        try:
            with self.db.session() as s:
                add_many(s, recs)
            return [None] * len(recs)
        except IntegrityError:
            return [self._record_one(r) for r in recs]
        except Exception:
            self._spool(recs)
            return [None] * len(recs)

    def _record_one(self, rec: UsageRecord) -> BaseException | None:
        try:
            self.record(rec)
            return None
        except IntegrityError as exc:
            log.error("usage for %s is already recorded; not writing it twice", rec.request_id)
            return exc

    # --- synchronous use (CLI, benches, tests) ------------------------------------------------------

    def record(self, rec: UsageRecord) -> None:
        """Commit one row now, or spool it if the database is down; IntegrityError if already stored."""
        try:
            with self.db.session() as s:
                add(s, rec)
        except IntegrityError:
            raise
        except Exception:
            self._spool([rec])

    def replay_spool(self) -> int:
        """Write spooled rows (skipping any already stored) and empty the spool; returns how many were
        spooled. Raises if the database is still unreachable (the spool is kept)."""
        return self.spool.drain(self._write_spooled)

    def _spool(self, recs: list[UsageRecord]) -> None:
        log.exception("usage for %d request(s) could not be written; spooling to %s", len(recs), self.spool.path)
        self.spool.append([r.to_json() for r in recs])
        self._next_drain = time.monotonic() + self._drain_wait

    def _drain_quietly(self) -> None:
        try:
            if n := self.replay_spool():
                log.warning("wrote %d spooled usage rows to the database", n)
            self._drain_wait = self.DRAIN_EVERY[0]
        except Exception:
            self._drain_wait = min(self._drain_wait * 2, self.DRAIN_EVERY[1])
            log.warning("the usage spool could not be written yet; next try in %.0f s", self._drain_wait)
        self._next_drain = time.monotonic() + self._drain_wait

    def _write_spooled(self, lines: list[str]) -> None:
        recs = {r.request_id: r for r in map(UsageRecord.from_json, lines)}
        ids = list(recs)
        for first in range(0, len(ids), self.MAX_BATCH):
            chunk = ids[first : first + self.MAX_BATCH]
            with self.db.session() as s:  # a chunk per transaction: a long spool does not hold locks long
                stored = set(s.scalars(select(Usage.request_id).where(Usage.request_id.in_(chunk))))
                if new := [recs[i] for i in chunk if i not in stored]:
                    add_many(s, new)


def rebuild_rollup(db: Database) -> int:
    """Recompute the daily rollup from the raw ledger (after a bulk load, or to check it)."""
    with db.session() as s:
        utc = func.timezone("UTC", Usage.created_at) if s.bind.dialect.name == "postgresql" else Usage.created_at  # type: ignore[union-attr]
        day = func.date(utc)
        s.query(UsageDaily).delete()
        rows = s.execute(
            select(
                Usage.tenant_id,
                day,
                Usage.tier,
                Usage.model,
                func.count(),
                *(func.sum(getattr(Usage, k)) for k in (*COUNTS, *AMOUNTS)),
            ).group_by(Usage.tenant_id, day, Usage.tier, Usage.model)
        ).all()
        for r in rows:
            s.add(
                UsageDaily(
                    tenant_id=r[0],
                    day=r[1] if not isinstance(r[1], str) else datetime.fromisoformat(r[1]).date(),
                    tier=r[2],
                    model=r[3],
                    requests=r[4],
                    **dict(zip((*COUNTS, *AMOUNTS), r[5:], strict=True)),
                )
            )
    return len(rows)
