"""The Responses API's state, which the gateway owns: each stored response with its input and the context a
continuation starts from, per tenant, until it expires.

A tenant sees only its own: another tenant's id, an expired one and a deleted one are the same 404 (not a 403,
which would say the id exists). Calls block; the routes run them in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from core.db.database import Database
from core.db.models import StoredResponse, as_utc
from gateway.http.errors import APIError

__all__ = ["ResponseStore", "Stored", "not_found"]

PURGE_BATCH = 100  # expired rows deleted per write: the table stays bounded without a sweeper thread


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    context: list[dict[str, Any]]


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No response with id {response_id!r} found.", param=param, code="response_not_found")


class ResponseStore:
    def __init__(self, db: Database, retention_days: float) -> None:
        self.db = db
        self.retention = timedelta(days=retention_days)

    def save(self, tenant_id: int, response: dict[str, Any], input_items: list, context: list) -> None:
        now = datetime.now(UTC)
        with self.db.session() as s:
            expired = sa.select(StoredResponse.id).where(StoredResponse.expires_at < now).limit(PURGE_BATCH)
            s.execute(sa.delete(StoredResponse).where(StoredResponse.id.in_(expired.scalar_subquery())))
            s.add(
                StoredResponse(
                    id=response["id"],
                    tenant_id=tenant_id,
                    response=response,
                    input_items=input_items,
                    context=context,
                    created_at=now,
                    expires_at=now + self.retention,
                )
            )

    def get(self, tenant_id: int, response_id: str, param: str | None = None) -> Stored:
        """The tenant's live stored response, or a 404."""
        with self.db.session() as s:
            row = s.get(StoredResponse, response_id)
            if row is None or row.tenant_id != tenant_id or as_utc(row.expires_at) <= datetime.now(UTC):
                raise not_found(response_id, param)
            return Stored(row.response, row.input_items, row.context)

    def delete(self, tenant_id: int, response_id: str) -> None:
        with self.db.session() as s:
            deleted = s.execute(
                sa.delete(StoredResponse).where(StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id)
            )
            if deleted.rowcount == 0:  # type: ignore[attr-defined]
                raise not_found(response_id)
