"""Shadow traffic: a share of a pipeline's requests also runs on a candidate version, read by every process.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pipeline_shadows",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("spec_sha256", sa.String(64), nullable=False),
        sa.Column("percent", sa.Float(), nullable=False),
        sa.Column("updated_by", sa.String(200), nullable=False),
        # store.db.UTCDateTime stores through this type; the revision must not import model code.
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("pipeline_shadows")
