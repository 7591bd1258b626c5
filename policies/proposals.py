"""Tuning proposals in SQL: what `policy tune` proposed for a tenant, and an admin's decision on it.

Applying writes the proposed policy as a new version through the policy store (audited there, action
`policy.tune`); rejecting is audited too. A proposal tuned from a version that is no longer in force is
stale: applying it would undo whatever changed since, so it is refused and the tuning must run again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session, defer

from core import audit
from core.db.database import Database
from core.db.models import PolicyProposal, utcnow
from policies.policy import Policy
from policies.store import PolicyStore
from policies.tuning import Tuning

PROPOSED, UNCHANGED, APPLIED, REJECTED = "proposed", "unchanged", "applied", "rejected"


class ProposalError(ValueError):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code  # not_found | decided | stale


@dataclass(frozen=True)
class Proposal:
    id: int
    tenant_id: int
    base_version: int
    status: str
    policy: dict  # as stored: validated when applied (an old proposal may predate today's schema)
    report: dict
    has_plot: bool
    created_by: str
    created_at: datetime | None
    decided_by: str | None
    decided_at: datetime | None
    applied_version: int | None


class ProposalStore:
    def __init__(self, db: Database, policies: PolicyStore) -> None:
        self.db = db
        self.policies = policies

    def save(
        self,
        tenant_id: int,
        base_version: int,
        tuning: Tuning,
        plot: bytes | None,
        actor: str,
        report: dict | None = None,
    ) -> int:
        """Store a tuning's result; one that keeps the current policy is stored as `unchanged` (evidence
        that the policy is already the cheapest), with nothing to apply."""
        status = UNCHANGED if tuning.chosen == "current" else PROPOSED
        with self.db.session() as s:
            row = PolicyProposal(
                tenant_id=tenant_id,
                base_version=base_version,
                status=status,
                policy=tuning.policy.model_dump(mode="json"),
                report=report if report is not None else tuning.as_dict(),
                plot=plot,
                created_by=actor[:64],
            )
            s.add(row)
            s.flush()
            return row.id

    def get(self, tenant_id: int, proposal_id: int) -> Proposal:
        with self.db.session() as s:
            row = _row(s, tenant_id, proposal_id)
            return _proposal(row, row.plot is not None)

    def plot(self, tenant_id: int, proposal_id: int) -> bytes | None:
        with self.db.session() as s:
            return _row(s, tenant_id, proposal_id).plot

    def list(self, tenant_id: int, limit: int = 50) -> list[Proposal]:
        with self.db.session() as s:
            rows = s.execute(
                select(PolicyProposal, PolicyProposal.plot.is_not(None))
                .options(defer(PolicyProposal.plot))  # the PNGs stay in the database: a list shows none
                .where(PolicyProposal.tenant_id == tenant_id)
                .order_by(PolicyProposal.id.desc())
                .limit(limit)
            )
            return [_proposal(row, bool(has_plot)) for row, has_plot in rows]

    def latest_created(self, tenant_id: int) -> datetime | None:
        """When the tenant's newest proposal was made (the schedule's clock)."""
        with self.db.session() as s:
            return s.scalar(
                select(PolicyProposal.created_at)
                .where(PolicyProposal.tenant_id == tenant_id)
                .order_by(PolicyProposal.id.desc())
                .limit(1)
            )

    def apply(self, tenant_id: int, proposal_id: int, actor: str) -> int:
        """The new policy version. The decision, the version and its audit row commit together; the decision
        is taken by a conditional update, so of two admins deciding at once one wins and the other gets
        `decided` (on SQLite too, where a row lock does nothing)."""
        with self.db.session() as s:
            row = self._decide(s, tenant_id, proposal_id, APPLIED, actor)
            current = self.policies.current_version(tenant_id, s)
            if current != row.base_version:  # raising rolls the decision back
                raise ProposalError(
                    f"the policy is at version {current}, and this proposal was tuned from version "
                    f"{row.base_version}: run the tuning again",
                    "stale",
                )
            try:
                policy = Policy.model_validate(row.policy)
            except ValueError as exc:
                raise ProposalError(f"the proposed policy is no longer valid: {exc}", "invalid") from None
            version = self.policies.write(
                s, tenant_id, policy, actor, f"tuning proposal {proposal_id}", action="policy.tune"
            )
            row.applied_version = version
        self.policies.invalidate(tenant_id)
        return version

    def reject(self, tenant_id: int, proposal_id: int, actor: str, reason: str = "") -> None:
        with self.db.session() as s:
            self._decide(s, tenant_id, proposal_id, REJECTED, actor)
            audit.record(
                s,
                actor,
                "policy.tune.reject",
                f"tuning proposal {proposal_id}",
                tenant_id=tenant_id,
                after={"reason": reason[:200]} if reason else None,
            )

    @staticmethod
    def _decide(s: Session, tenant_id: int, proposal_id: int, status: str, actor: str) -> PolicyProposal:
        """Mark an open proposal decided, as the transaction's first write; raise if it is not open."""
        done = s.execute(
            update(PolicyProposal)
            .where(
                PolicyProposal.id == proposal_id,
                PolicyProposal.tenant_id == tenant_id,
                PolicyProposal.status == PROPOSED,
            )
            .values(status=status, decided_by=actor[:64], decided_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        row = _row(s, tenant_id, proposal_id)
        if done.rowcount != 1:
            raise ProposalError(f"proposal {proposal_id} is {row.status}: nothing to decide", "decided")
        return row


def _row(s: Session, tenant_id: int, proposal_id: int) -> PolicyProposal:
    """The tenant's proposal, as the database has it now; another tenant's does not exist here."""
    row = s.get(PolicyProposal, proposal_id, populate_existing=True)
    if row is None or row.tenant_id != tenant_id:
        raise ProposalError(f"no proposal {proposal_id}", "not_found")
    return row


def _proposal(row: PolicyProposal, has_plot: bool) -> Proposal:
    return Proposal(
        id=row.id,
        tenant_id=row.tenant_id,
        base_version=row.base_version,
        status=row.status,
        policy=row.policy,
        report=row.report,
        has_plot=has_plot,
        created_by=row.created_by,
        created_at=row.created_at,
        decided_by=row.decided_by,
        decided_at=row.decided_at,
        applied_version=row.applied_version,
    )
