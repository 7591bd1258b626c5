"""policies, audit log, a priced ledger and its daily rollup

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from core.db.models import MoneyType

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

MONEY = MoneyType()  # NUMERIC(24, 10); integer 1e-10 dollars on SQLite
ZERO = sa.text("0")
AMOUNTS = (
    "cost",
    "counterfactual_cost",
    "saved_cache",
    "saved_routing",
    "saved_speculation",
    "saved_verifier",
    "saved_policy",
)


def upgrade() -> None:
    with op.batch_alter_table("tenants") as t:
        t.add_column(sa.Column("is_operator", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("usage") as t:
        t.add_column(sa.Column("tier", sa.String(32), nullable=False, server_default=""))
        for name in ("cached_prompt_tokens", "draft_proposed", "draft_accepted", "effective_max_tokens"):
            t.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default=ZERO))
        t.add_column(sa.Column("requested_max_tokens", sa.Integer(), nullable=True))
        t.add_column(sa.Column("cache_status", sa.String(16), nullable=False, server_default="miss"))
        t.add_column(sa.Column("route", sa.String(32), nullable=False, server_default="direct"))
        t.add_column(sa.Column("verifier_actions", sa.JSON(), nullable=False, server_default="[]"))
        t.add_column(sa.Column("policy_version", sa.Integer(), nullable=False, server_default=ZERO))
        for name in AMOUNTS:
            t.add_column(sa.Column(name, MONEY, nullable=False, server_default=ZERO))
    op.execute("UPDATE usage SET tier = model")
    op.create_table(
        "usage_daily",
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("day", sa.Date(), primary_key=True),
        sa.Column("tier", sa.String(32), primary_key=True),
        sa.Column("model", sa.String(100), primary_key=True),
        *(
            sa.Column(name, sa.BigInteger(), nullable=False)
            for name in (
                "requests",
                "prompt_tokens",
                "cached_prompt_tokens",
                "completion_tokens",
                "draft_proposed",
                "draft_accepted",
            )
        ),
        *(sa.Column(name, MONEY, nullable=False) for name in AMOUNTS),
    )
    op.create_table(
        "policy_versions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("note", sa.String(200), nullable=False),
        sa.Column("created_by", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("tenant_id", "version", name="uq_policy_versions_tenant_version"),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=True),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("target", sa.String(200), nullable=False),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_audit_log_tenant_created", "audit_log", ["tenant_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_audit_log_tenant_created", table_name="audit_log")
    op.drop_table("audit_log")
    op.drop_table("policy_versions")
    op.drop_table("usage_daily")
    with op.batch_alter_table("usage") as t:
        for name in (
            *AMOUNTS,
            "policy_version",
            "verifier_actions",
            "route",
            "cache_status",
            "requested_max_tokens",
            "effective_max_tokens",
            "draft_accepted",
            "draft_proposed",
            "cached_prompt_tokens",
            "tier",
        ):
            t.drop_column(name)
    with op.batch_alter_table("tenants") as t:
        t.drop_column("is_operator")
