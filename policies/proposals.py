"""Tuning proposals in SQL: what `policy tune` proposed for a tenant, and an admin's decision on it.

Applying writes the proposed policy as a new version through the policy store (audited there, action
`policy.tune`); rejecting is audited too. A proposal tuned from a version that is no longer in force is
stale: applying it would undo whatever changed since, so it is refused and the tuning must run again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from gateway import audit
from gateway.db.database import Database
from gateway.db.models import PolicyProposal, utcnow
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
    policy: Policy
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
            row = s.get(PolicyProposal, proposal_id)
            if row is None or row.tenant_id != tenant_id:  # another tenant's proposal does not exist here
                raise ProposalError(f"no proposal {proposal_id}", "not_found")
            return _proposal(row)

    def plot(self, tenant_id: int, proposal_id: int) -> bytes | None:
        with self.db.session() as s:
            row = s.get(PolicyProposal, proposal_id)
            if row is None or row.tenant_id != tenant_id:
                raise ProposalError(f"no proposal {proposal_id}", "not_found")
            return row.plot

    def list(self, tenant_id: int, limit: int = 50) -> list[Proposal]:
        with self.db.session() as s:
            rows = s.scalars(
                select(PolicyProposal)
                .where(PolicyProposal.tenant_id == tenant_id)
                .order_by(PolicyProposal.id.desc())
                .limit(limit)
            )
            return [_proposal(r) for r in rows]

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
        """The new policy version. The decision is recorded in the same transaction as the version and its
        audit row, so two admins applying at once make one version (the other gets `decided`)."""
        with self.db.session() as s:
            row = self._open(s, tenant_id, proposal_id)
            current = self.policies.current_version(tenant_id, s)
            if current != row.base_version:
                raise ProposalError(
                    f"the policy is at version {current}, and this proposal was tuned from version "
                    f"{row.base_version}: run the tuning again",
                    "stale",
                )
            policy = Policy.model_validate(row.policy)
            version = self.policies.write(
                s, tenant_id, policy, actor, f"tuning proposal {proposal_id}", action="policy.tune"
            )
            row.status, row.decided_by, row.decided_at, row.applied_version = APPLIED, actor[:64], utcnow(), version
        self.policies.invalidate(tenant_id)
        return version

    def reject(self, tenant_id: int, proposal_id: int, actor: str, reason: str = "") -> None:
        with self.db.session() as s:
            row = self._open(s, tenant_id, proposal_id)
            row.status, row.decided_by, row.decided_at = REJECTED, actor[:64], utcnow()
            audit.record(
                s,
                actor,
                "policy.tune.reject",
                f"tuning proposal {proposal_id}",
                tenant_id=tenant_id,
                after={"reason": reason[:200]} if reason else None,
            )

    @staticmethod
    def _open(s: Session, tenant_id: int, proposal_id: int) -> PolicyProposal:
        row = s.get(PolicyProposal, proposal_id, with_for_update=True)
        if row is None or row.tenant_id != tenant_id:
            raise ProposalError(f"no proposal {proposal_id}", "not_found")
        if row.status != PROPOSED:
            raise ProposalError(f"proposal {proposal_id} is {row.status}: nothing to decide", "decided")
        return row


def _proposal(row: PolicyProposal) -> Proposal:
    return Proposal(
        id=row.id,
        tenant_id=row.tenant_id,
        base_version=row.base_version,
        status=row.status,
        policy=Policy.model_validate(row.policy),
        report=row.report,
        has_plot=row.plot is not None,
        created_by=row.created_by,
        created_at=row.created_at,
        decided_by=row.decided_by,
        decided_at=row.decided_at,
        applied_version=row.applied_version,
    )
