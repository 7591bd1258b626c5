"""routed prompts: the conversations the router decided on, for tenants that let us keep them

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "routed_prompts",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("p_small_ok", sa.Float(), nullable=False),
        sa.Column("tier", sa.String(32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_routed_prompts_tenant_id", "routed_prompts", ["tenant_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_routed_prompts_tenant_id", table_name="routed_prompts")
    op.drop_table("routed_prompts")
