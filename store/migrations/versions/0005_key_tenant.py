"""API keys name their tenant (``inferline keys create --tenant``).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02

Until now a key's tenant was its name; existing keys keep that, written into the new column.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A pre-Alembic database adopted by 0001 may already have been made from the current models.
    if "tenant" in {column["name"] for column in sa.inspect(op.get_bind()).get_columns("api_keys")}:
        return
    op.add_column("api_keys", sa.Column("tenant", sa.String(200), nullable=True))
    op.execute("UPDATE api_keys SET tenant = name")


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("tenant")
