"""MCP tool definitions pinned with the pipeline version that first listed them (an agent step's tools).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tool_pins",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec_sha256", sa.String(64), nullable=False),
        sa.Column("tool", sa.String(500), nullable=False),
        sa.Column("schema_sha256", sa.String(64), nullable=False),
        # store.db.UTCDateTime stores through this type; the revision must not import model code.
        sa.Column("pinned_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("name", "spec_sha256", "tool"),
    )


def downgrade() -> None:
    op.drop_table("tool_pins")
