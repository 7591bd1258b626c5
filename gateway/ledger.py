"""The ledger: exactly one priced usage row per request that ran, and its daily rollup.

The request id is the primary key, so a second row for a request cannot exist. The row and its
rollup increment commit in one transaction, so the rollup always equals the sum of the raw rows and
reports never scan them. If the database is unreachable the row goes to a spool file under the home
directory and is replayed (rollup included) on the next start: usage is never dropped.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from gateway.db.database import Database
from gateway.db.models import Usage, UsageDaily, utcnow

log = logging.getLogger(__name__)

COUNTS = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "draft_proposed", "draft_accepted")
AMOUNTS = (
    "cost",
    "counterfactual_cost",
    "saved_cache",
    "saved_routing",
    "saved_speculation",
    "saved_verifier",
    "saved_policy",
)


@dataclass(frozen=True)
class UsageRecord:
    request_id: str
    tenant_id: int
    api_key_id: int | None
    endpoint: str
    model: str
    tier: str
    prompt_tokens: int
    completion_tokens: int
    latency_ms: int
    status: str  # ok | aborted | error
    finish_reason: str | None
    cached_prompt_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    requested_max_tokens: int | None = None
    effective_max_tokens: int = 0
    cache_status: str = "miss"
    route: str = "direct"
    verifier_actions: list = field(default_factory=list)
    policy_version: int = 0
    cost: Decimal = Decimal(0)
    counterfactual_cost: Decimal = Decimal(0)
    saved_cache: Decimal = Decimal(0)
    saved_routing: Decimal = Decimal(0)
    saved_speculation: Decimal = Decimal(0)
    saved_verifier: Decimal = Decimal(0)
    saved_policy: Decimal = Decimal(0)
    created_at: datetime = field(default_factory=utcnow)

    def to_json(self) -> str:
        d = asdict(self)
        d["created_at"] = self.created_at.isoformat()
        return json.dumps(d, default=str)

    @classmethod
    def from_json(cls, line: str) -> UsageRecord:
        d: dict[str, Any] = json.loads(line)
        d["created_at"] = datetime.fromisoformat(d["created_at"])
        for name in AMOUNTS:
            d[name] = Decimal(d[name])
        return cls(**d)


_UPSERTS: dict[str, Any] = {}


def _rollup_upsert(dialect: str) -> Any:
    """INSERT … ON CONFLICT DO UPDATE adding every count and amount; built once per dialect, since
    building it costs more than running it."""
    if dialect not in _UPSERTS:
        stmt = (postgresql if dialect == "postgresql" else sqlite).insert(UsageDaily)
        added = ("requests", *COUNTS, *AMOUNTS)
        _UPSERTS[dialect] = stmt.on_conflict_do_update(
            index_elements=["tenant_id", "day", "tier", "model"],
            set_={k: getattr(UsageDaily, k) + getattr(stmt.excluded, k) for k in added},
        )
    return _UPSERTS[dialect]


_INSERT_USAGE = insert(Usage)


def add(session: Session, rec: UsageRecord) -> None:
    """The usage row and its rollup increment, in the caller's transaction (Core statements: the
    ORM's unit of work would double the time of the one write on every request's path)."""
    row = asdict(rec)
    session.execute(_INSERT_USAGE, row)  # a duplicate request id fails here, before the rollup is touched
    day = {"tenant_id": rec.tenant_id, "day": rec.created_at.date(), "tier": rec.tier, "model": rec.model}
    session.execute(
        _rollup_upsert(session.bind.dialect.name),  # type: ignore[union-attr]
        {**day, "requests": 1, **{k: row[k] for k in (*COUNTS, *AMOUNTS)}},
    )


class Ledger:
    def __init__(self, db: Database, spool: Path) -> None:
        self.db = db
        self.spool = spool

    def record(self, rec: UsageRecord) -> None:
        try:
            with self.db.session() as s:
                add(s, rec)
        except OperationalError:
            log.exception("usage for %s could not be written; spooling it to %s", rec.request_id, self.spool)
            self.spool.parent.mkdir(parents=True, exist_ok=True)
            with self.spool.open("a") as f:
                f.write(rec.to_json() + "\n")

    def replay_spool(self) -> int:
        """Write spooled rows (skipping any already stored); returns how many were added."""
        if not self.spool.exists():
            return 0
        added = 0
        for line in self.spool.read_text().splitlines():
            rec = UsageRecord.from_json(line)
            with self.db.session() as s:
                if s.scalar(select(Usage.request_id).where(Usage.request_id == rec.request_id)) is None:
                    add(s, rec)
                    added += 1
        self.spool.unlink()
        return added


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
