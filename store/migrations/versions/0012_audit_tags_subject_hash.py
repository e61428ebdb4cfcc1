"""Audit records keep the request's tags and, with content encrypted, the keyed hash of their subject;
audit_append() stores both.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-08

Both columns are chained only when set (store/audit_chain.py), so the records chained before this
revision keep their hashes. The PostgreSQL function is revision 0004's as revision 0009 left it, with
the two columns added to its column list.
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_KEY_ID = importlib.import_module("store.migrations.versions.0009_checkpoint_key_id")
_INDEX = "ix_audit_records_subject_hash"
_LAST_COLUMNS = "request_id, trace_id, pruned, legal_hold)"
_LAST_VALUES = "r.request_id, r.trace_id, COALESCE(r.pruned, 'null'::json), false"


def _function(new: bool) -> str:
    text = _KEY_ID._function(new=True)
    if not new:
        return text
    assert _LAST_COLUMNS in text and _LAST_VALUES in text
    return (text.replace(_LAST_COLUMNS, "request_id, trace_id, pruned, legal_hold, tags, subject_hash)")
            .replace(_LAST_VALUES, _LAST_VALUES + ", r.tags, r.subject_hash"))


def upgrade() -> None:
    op.add_column("audit_records", sa.Column("tags", sa.Text(), nullable=True))
    op.add_column("audit_records", sa.Column("subject_hash", sa.String(64), nullable=True))
    op.create_index(_INDEX, "audit_records", ["subject_hash"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_function(new=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_function(new=False))
    op.drop_index(_INDEX, "audit_records")
    # ALTER TABLE ... DROP COLUMN on both (SQLite since 3.35): no copy of the table, whose rows
    # audit_stages references.
    op.execute("ALTER TABLE audit_records DROP COLUMN subject_hash")
    op.execute("ALTER TABLE audit_records DROP COLUMN tags")
