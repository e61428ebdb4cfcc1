"""Traffic split between a pipeline's versions (a canary), read by every serving process.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pipeline_traffic",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("weights", sa.JSON(), nullable=False),
        sa.Column("updated_by", sa.String(200), nullable=False),
        # store.db.UTCDateTime stores through this type; the revision must not import model code.
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("pipeline_traffic")
