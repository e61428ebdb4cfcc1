"""Requests paused for the client's approval of tool calls (an agent step's require_approval), kept until resumed.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "paused_requests",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=True),
        sa.Column("pipeline", sa.String(200), nullable=False),
        sa.Column("state", sa.JSON(), nullable=False),
        # store.db.UTCDateTime stores through this type; the revision must not import model code.
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_paused_requests_owner", "paused_requests", ["owner"])
    op.create_index("ix_paused_requests_expires_at", "paused_requests", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_paused_requests_expires_at", "paused_requests")
    op.drop_index("ix_paused_requests_owner", "paused_requests")
    op.drop_table("paused_requests")
