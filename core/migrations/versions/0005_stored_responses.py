"""stored responses (what the Responses API keeps per tenant) and the usage row's requested model (an alias)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("context", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_stored_responses_expires_at", "stored_responses", ["expires_at"])
    with op.batch_alter_table("usage") as batch:  # SQLite alters a table by copying it: batch mode
        batch.add_column(sa.Column("requested_model", sa.String(100), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("requested_model")
    op.drop_index("ix_stored_responses_expires_at", table_name="stored_responses")
    op.drop_table("stored_responses")
