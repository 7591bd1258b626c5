"""Routed conversations in SQL (`routed_prompts`), kept for the tenants whose policy opts in
(`router.store_prompts`, off by default): what a tenant's own threshold is calibrated on.

Why a table and not the prompt log (`logging.log_prompts`): that log is a stream of lines for people,
holding the prompt as the model saw it (chat template applied); calibration needs the conversation as
the router sees it, per tenant, newest first, from any replica. Each tenant keeps its newest
`KEEP_PER_TENANT` rows: calibration reads no more than that, so older ones are only a liability.
"""

from __future__ import annotations

from sqlalchemy import delete, select

from core.db.database import Database
from core.db.models import RoutedPrompt
from router_model.features import Messages

KEEP_PER_TENANT = 5000
PRUNE_EVERY = 100  # rows a process stores between two prunes of a tenant


class RoutedPromptStore:
    def __init__(self, db: Database, keep: int = KEEP_PER_TENANT) -> None:
        self.db = db
        self.keep = keep
        self._stored: dict[int, int] = {}  # tenant → rows stored by this process

    def add(self, tenant_id: int, request_id: str, messages: Messages, p_small_ok: float, tier: str) -> None:
        """Store one routed conversation (blocking: call it from a worker thread)."""
        row = RoutedPrompt(
            tenant_id=tenant_id,
            request_id=request_id,
            messages=[dict(m) for m in messages],
            p_small_ok=p_small_ok,
            tier=tier,
        )
        with self.db.session() as s:
            s.add(row)
        n = self._stored[tenant_id] = self._stored.get(tenant_id, 0) + 1
        if n % PRUNE_EVERY == 1:  # the first store of a process prunes too: a restart must not skip it
            self.prune(tenant_id)

    def prune(self, tenant_id: int) -> None:
        with self.db.session() as s:
            oldest_kept = s.scalar(
                select(RoutedPrompt.id)
                .where(RoutedPrompt.tenant_id == tenant_id)
                .order_by(RoutedPrompt.id.desc())
                .offset(self.keep - 1)
                .limit(1)
            )
            if oldest_kept is not None:
                s.execute(
                    delete(RoutedPrompt).where(RoutedPrompt.tenant_id == tenant_id, RoutedPrompt.id < oldest_kept)
                )

    def recent(self, tenant_id: int, limit: int = KEEP_PER_TENANT) -> list[Messages]:
        """The tenant's newest conversations, at most `limit`."""
        with self.db.session() as s:
            rows = s.scalars(
                select(RoutedPrompt.messages)
                .where(RoutedPrompt.tenant_id == tenant_id)
                .order_by(RoutedPrompt.id.desc())
                .limit(limit)
            )
            return list(rows)
