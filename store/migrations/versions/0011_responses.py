"""Stored responses of the Responses API (POST /v1/responses with store: true).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=True),
        sa.Column("pipeline", sa.String(200), nullable=False),
        sa.Column("conversation", sa.JSON(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        # store.db.UTCDateTime stores through this type; the revision must not import model code.
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_responses_owner", "responses", ["owner"])
    op.create_index("ix_responses_expires_at", "responses", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_responses_expires_at", "responses")
    op.drop_index("ix_responses_owner", "responses")
    op.drop_table("responses")
