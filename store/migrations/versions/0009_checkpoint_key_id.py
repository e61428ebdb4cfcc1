"""Checkpoints name the key that signed them (Ed25519 key rotation); audit_append() stores it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_APPEND = importlib.import_module("store.migrations.versions.0004_audit_append")
_BEFORE = """        INSERT INTO audit_checkpoints (seq, head_hash, signature, algorithm, created_at)
        SELECT c.seq, c.head_hash, c.signature, c.algorithm, c.created_at"""
_AFTER = """        INSERT INTO audit_checkpoints (seq, head_hash, signature, algorithm, key_id, created_at)
        SELECT c.seq, c.head_hash, c.signature, c.algorithm, COALESCE(c.key_id, ''), c.created_at"""


def _function(new: bool) -> str:
    text = _APPEND.FUNCTION.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
    assert _BEFORE in text
    return text.replace(_BEFORE, _AFTER) if new else text


def upgrade() -> None:
    op.add_column("audit_checkpoints", sa.Column("key_id", sa.String(64), nullable=False, server_default=sa.text("''")))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_function(new=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_function(new=False))
    with op.batch_alter_table("audit_checkpoints") as batch:
        batch.drop_column("key_id")
