"""Encrypted audit content: data keys per subject (wrapped by the master key) and content_mode 'encrypted'.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_BEFORE = "content_mode IN ('full', 'redacted', 'hash')"
_AFTER = "content_mode IN ('full', 'redacted', 'hash', 'encrypted')"


def _content_modes(condition: str) -> None:
    # SQLite rebuilds the table to change a CHECK constraint (a copy of every record: slow on a big log,
    # once); PostgreSQL swaps the constraint in place.
    with op.batch_alter_table("audit_records", recreate="auto") as batch:
        batch.drop_constraint("content_mode", type_="check")
        batch.create_check_constraint("content_mode", condition)


def upgrade() -> None:
    op.create_table(
        "audit_data_keys",
        sa.Column("key_id", sa.String(32), primary_key=True),
        sa.Column("subject_id", sa.String(64), nullable=False),
        sa.Column("wrapped", sa.Text(), nullable=True),
        # store.db.UTCDateTime stores through this type; the revision must not import model code.
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("erased_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("erased_by", sa.String(200), nullable=True),
    )
    op.create_index("ix_audit_data_keys_subject_id", "audit_data_keys", ["subject_id"])
    _content_modes(_AFTER)


def downgrade() -> None:
    _content_modes(_BEFORE)
    op.drop_index("ix_audit_data_keys_subject_id", "audit_data_keys")
    op.drop_table("audit_data_keys")
