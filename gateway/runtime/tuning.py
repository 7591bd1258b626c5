"""Policy tuning on each tenant's schedule (`tuning.schedule` in its policy), on the live engines.

Every `tuning_check_seconds` the gateway looks for tenants whose schedule is due (no proposal in the
period) and tunes them one at a time, its requests queued behind live traffic (a lower priority). A run
stores a proposal for an admin; it is applied only where the tenant opted in (`tuning.auto_apply`). A run
that fails (no stored prompts yet, a tier down) is logged and not retried before its next period.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from core.db.database import Database
from core.db.models import Tenant, as_utc
from engines.protocol import TierEngine
from policies.proposals import PROPOSED, ProposalError, ProposalStore
from policies.store import PolicyStore
from policies.tune_run import TuneRequest, tune_tenant
from policies.tuning import Candidate
from verifiers.policy import tuning_hook

log = logging.getLogger(__name__)

PERIODS = {"daily": timedelta(days=1), "weekly": timedelta(days=7)}
ACTOR = "schedule"


class TuningSchedule:
    def __init__(
        self,
        db: Database,
        policies: PolicyStore,
        proposals: ProposalStore,
        engines: Mapping[str, TierEngine],
        home: Path,
        *,
        variants: Sequence[Candidate] | None = None,
        max_tokens: int = 512,
    ) -> None:
        """`variants` and `max_tokens`: the tunings' candidates (default: all) and what a replayed request
        asks for."""
        self.db = db
        self.policies = policies
        self.proposals = proposals
        self.engines = engines
        self.home = home
        self.variants = variants
        self.max_tokens = max_tokens
        self._failed: dict[int, datetime] = {}  # tenant → when its last run failed

    def due(self, now: datetime) -> list[int]:
        """Tenants whose schedule asks for a run: none in the last period (made or failed)."""
        with self.db.session() as s:
            tenants = list(s.scalars(select(Tenant.id).order_by(Tenant.id)))
        out = []
        for tenant_id in tenants:
            tuning = self.policies.current(tenant_id).policy.tuning
            if tuning.schedule == "off":
                continue
            last = [t for t in (self.proposals.latest_created(tenant_id), self._failed.get(tenant_id)) if t]
            if not last or now - max(as_utc(t) for t in last) >= PERIODS[tuning.schedule]:
                out.append(tenant_id)
        return out

    async def run_due(self, now: datetime | None = None) -> list[int]:
        """Tune every due tenant; the proposals made (applied too where the tenant opted in)."""
        now = now or datetime.now(UTC)
        made = []
        for tenant_id in await anyio.to_thread.run_sync(self.due, now):
            versioned = await anyio.to_thread.run_sync(self.policies.current, tenant_id)
            t = versioned.policy.tuning
            request = TuneRequest(
                tenant_id, dataset=t.dataset, sample=t.sample, tolerance=t.tolerance, max_tokens=self.max_tokens
            )
            try:
                pid, _ = await tune_tenant(
                    request,
                    self.engines,
                    self.policies,
                    self.proposals,
                    self.home,
                    ACTOR,
                    hooks=tuning_hook,
                    variants=self.variants,
                )
            except Exception:  # one tenant's failed run must not stop the others', nor the gateway
                log.exception("scheduled policy tuning failed for tenant %d", tenant_id)
                self._failed[tenant_id] = now
                continue
            made.append(pid)
            if t.auto_apply:
                await self._auto_apply(tenant_id, pid)
        return made

    async def _auto_apply(self, tenant_id: int, pid: int) -> None:
        """Apply a tenant's fresh proposal; a refusal (the policy changed during the run, another replica
        decided first) is logged and leaves the proposal for an admin."""
        try:
            proposal = await anyio.to_thread.run_sync(self.proposals.get, tenant_id, pid)
            if proposal.status != PROPOSED:
                return
            version = await anyio.to_thread.run_sync(self.proposals.apply, tenant_id, pid, f"{ACTOR} (auto_apply)")
        except (ProposalError, IntegrityError) as exc:
            log.warning("tenant %d: tuning proposal %d not applied: %s", tenant_id, pid, exc)
            return
        log.info("tenant %d: tuning proposal %d applied as policy v%d (auto_apply)", tenant_id, pid, version)
