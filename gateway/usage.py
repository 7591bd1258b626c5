"""Usage rows: exactly one per request that ran, whatever way it ended.

The request id is the primary key, so a second row for a request cannot exist. If the database is
unreachable the row goes to a spool file under the home directory and is replayed on the next start:
usage is never dropped.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from gateway.db.database import Database
from gateway.db.models import Usage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UsageRecord:
    request_id: str
    tenant_id: int
    api_key_id: int | None
    endpoint: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    latency_ms: int
    status: str  # ok | aborted | error
    finish_reason: str | None


class UsageRecorder:
    def __init__(self, db: Database, spool: Path) -> None:
        self.db = db
        self.spool = spool

    def record(self, rec: UsageRecord) -> None:
        try:
            with self.db.session() as s:
                s.add(Usage(**asdict(rec)))
        except OperationalError:
            log.exception("usage for %s could not be written; spooling it to %s", rec.request_id, self.spool)
            self.spool.parent.mkdir(parents=True, exist_ok=True)
            with self.spool.open("a") as f:
                f.write(json.dumps(asdict(rec)) + "\n")

    def replay_spool(self) -> int:
        """Write spooled rows (skipping any already stored); returns how many were added."""
        if not self.spool.exists():
            return 0
        added = 0
        for line in self.spool.read_text().splitlines():
            rec = UsageRecord(**json.loads(line))
            with self.db.session() as s:
                if s.scalar(select(Usage.request_id).where(Usage.request_id == rec.request_id)) is None:
                    s.add(Usage(**asdict(rec)))
                    added += 1
        self.spool.unlink()
        return added
