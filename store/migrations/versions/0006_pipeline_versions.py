"""Pipeline versions: each pipeline file loaded, with its YAML text (store/pipeline_versions.py).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pipeline_versions",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("label", sa.String(64), nullable=False),
        sa.Column("spec_sha256", sa.String(64), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("source", sa.String(1000), nullable=False),
        sa.Column("deployed_by", sa.String(200), nullable=False),
        # store.db.UTCDateTime stores through this type; the revision must not import model code.
        sa.Column("deployed_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("name", "spec_sha256", name="uq_pipeline_versions_name"),
    )
    op.create_index("ix_pipeline_versions_name_deployed_at", "pipeline_versions", ["name", "deployed_at"])
    op.create_index("ix_pipeline_versions_spec_sha256", "pipeline_versions", ["spec_sha256"])


def downgrade() -> None:
    op.drop_index("ix_pipeline_versions_spec_sha256", "pipeline_versions")
    op.drop_index("ix_pipeline_versions_name_deployed_at", "pipeline_versions")
    op.drop_table("pipeline_versions")
