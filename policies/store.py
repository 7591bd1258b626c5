"""Policies in SQL, one immutable row per version, cached in-process.

The highest version is in force; a tenant with none runs the built-in default (version 0). Saving
and rolling back both write a new version and an audit row in one transaction. The cache is dropped
for a tenant the moment this process changes its policy, and re-checked against SQL every
`ttl` seconds so other gateway replicas pick up a change within that. While the database cannot be
reached, a policy read in the last `stale_for` seconds stays in force (requests keep their limits and
prices); a tenant whose policy is older than that, or was never read, gets the database's error.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core import audit
from core.db.database import UNREACHABLE, Database
from core.db.models import PolicyVersion
from policies.policy import Policy

log = logging.getLogger(__name__)

DEFAULT = Policy()


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class Versioned:
    version: int
    policy: Policy
    note: str = ""
    created_by: str = ""
    created_at: datetime | None = None


class PolicyStore:
    RETRY_AFTER = 1.0  # seconds an unreachable database is not asked again; cached policies serve meanwhile

    def __init__(self, db: Database, ttl: float = 1.0, stale_for: float = 300.0) -> None:
        self.db = db
        self.ttl = ttl
        self.stale_for = stale_for
        self._cache: dict[int, tuple[float, Versioned]] = {}  # tenant → (when read, policy)
        self._unreachable_until = 0.0
        self._lock = threading.Lock()
        self._refreshing: set[int] = set()  # tenants whose expired policy one caller is re-reading

    def cached(self, tenant_id: int) -> Versioned | None:
        """The cached policy if it is fresh, or not too stale while the database is unreachable: no SQL,
        safe to call on the event loop."""
        hit = self._cache.get(tenant_id)
        if hit is None:
            return None
        age = time.monotonic() - hit[0]
        down = time.monotonic() < self._unreachable_until
        if age < self.ttl or (down and age < self.stale_for):
            return hit[1]
        # Just expired: the first caller re-reads it (None sends it to `current`), the others keep the
        # old one for at most another ttl meanwhile, so a burst does not put every request on SQL at once.
        if age < 2 * self.ttl:
            with self._lock:
                if tenant_id in self._refreshing:
                    return hit[1]
                self._refreshing.add(tenant_id)
        return None

    def current(self, tenant_id: int) -> Versioned:
        try:
            return self._current(tenant_id)
        finally:
            self._refreshing.discard(tenant_id)

    def _current(self, tenant_id: int) -> Versioned:
        now = time.monotonic()
        hit = self._cache.get(tenant_id)
        if hit is not None and now - hit[0] < self.ttl:
            return hit[1]
        try:
            with self.db.session() as s:
                row = s.scalar(
                    select(PolicyVersion)
                    .where(PolicyVersion.tenant_id == tenant_id)
                    .order_by(PolicyVersion.version.desc())
                    .limit(1)
                )
        except UNREACHABLE:
            self._unreachable_until = time.monotonic() + self.RETRY_AFTER
            seen = self._cache.get(tenant_id)
            if seen is None or now - seen[0] >= self.stale_for:
                raise
            log.warning("database unreachable: tenant %d keeps its policy read %.0f s ago", tenant_id, now - seen[0])
            return seen[1]
        found = Versioned(0, DEFAULT) if row is None else _versioned(row)
        with self._lock:
            self._cache[tenant_id] = (now, found)
        return found

    def save(self, tenant_id: int, policy: Policy, actor: str, note: str = "", action: str = "policy.update") -> int:
        with self.db.session() as s:
            version = self.write(s, tenant_id, policy, actor, note, action)
        self.invalidate(tenant_id)
        return version

    def write(
        self, s: Session, tenant_id: int, policy: Policy, actor: str, note: str = "", action: str = "policy.update"
    ) -> int:
        """Add the next version and its audit row in the caller's transaction (the caller invalidates
        the cache once it commits)."""
        before = self._latest(s, tenant_id)
        version = (before.version if before else 0) + 1
        body = policy.model_dump(mode="json")
        s.add(PolicyVersion(tenant_id=tenant_id, version=version, body=body, note=note[:200], created_by=actor))
        audit.record(
            s,
            actor,
            action,
            f"policy v{version}",
            tenant_id=tenant_id,
            before=before.body if before else DEFAULT.model_dump(mode="json"),
            after=body,
        )
        return version

    @staticmethod
    def current_version(tenant_id: int, s: Session) -> int:
        """The version in force, read in the caller's transaction (0: the built-in default)."""
        top = s.scalar(select(func.max(PolicyVersion.version)).where(PolicyVersion.tenant_id == tenant_id))
        return top or 0

    def rollback(self, tenant_id: int, version: int, actor: str) -> int:
        target = self.version(tenant_id, version)
        return self.save(tenant_id, target.policy, actor, note=f"rollback to v{version}", action="policy.rollback")

    def version(self, tenant_id: int, version: int) -> Versioned:
        if version == 0:
            return Versioned(0, DEFAULT, note="built-in default")
        with self.db.session() as s:
            row = s.scalar(
                select(PolicyVersion).where(PolicyVersion.tenant_id == tenant_id, PolicyVersion.version == version)
            )
        if row is None:
            raise PolicyError(f"no policy version {version}")
        return _versioned(row)

    def history(self, tenant_id: int) -> list[Versioned]:
        with self.db.session() as s:
            rows = s.scalars(
                select(PolicyVersion).where(PolicyVersion.tenant_id == tenant_id).order_by(PolicyVersion.version.desc())
            )
            return [_versioned(r) for r in rows]

    def invalidate(self, tenant_id: int) -> None:
        with self._lock:
            self._cache.pop(tenant_id, None)

    @staticmethod
    def _latest(s: Session, tenant_id: int) -> PolicyVersion | None:
        top = PolicyStore.current_version(tenant_id, s)
        if top == 0:  # no version stored: the built-in default
            return None
        return s.scalar(select(PolicyVersion).where(PolicyVersion.tenant_id == tenant_id, PolicyVersion.version == top))


def _versioned(row: PolicyVersion) -> Versioned:
    return Versioned(row.version, Policy.model_validate(row.body), row.note, row.created_by, row.created_at)
