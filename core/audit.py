"""The audit log: every change to tenants, keys and policies, with who, when, before and after."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db.database import Database
from core.db.models import AuditEntry


def record(
    session: Session,
    actor: str,
    action: str,
    target: str,
    *,
    tenant_id: int | None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> None:
    """Add an entry in the caller's transaction: the change and its audit row commit together."""
    session.add(AuditEntry(tenant_id=tenant_id, actor=actor, action=action, target=target, before=before, after=after))


def entries(db: Database, tenant_id: int | None = None, limit: int = 100) -> list[AuditEntry]:
    """Newest first; `tenant_id` None means every tenant's (operator view)."""
    with db.session() as s:
        q = select(AuditEntry).order_by(AuditEntry.created_at.desc(), AuditEntry.id.desc()).limit(limit)
        if tenant_id is not None:
            q = q.where(AuditEntry.tenant_id == tenant_id)
        return list(s.scalars(q))
