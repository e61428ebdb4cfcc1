"""Rate-limit and budget counters (store.counters.LimitCounter).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "limit_counters",
        sa.Column("key", sa.String(300), nullable=False),
        sa.Column("window_start", sa.BigInteger(), nullable=False),
        sa.Column("window_s", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("key", "window_start", name=op.f("pk_limit_counters")),
    )


def downgrade() -> None:
    op.drop_table("limit_counters")
