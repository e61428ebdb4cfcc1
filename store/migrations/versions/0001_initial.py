"""Initial schema: API keys and the tamper-evident audit log.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

GENESIS_HASH = "0" * 64  # store.audit.models.GENESIS_HASH, frozen here as revisions must be


def _utc() -> sa.DateTime:
    # store.db.UTCDateTime stores through this type; the revision must not import model code.
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    # Databases made by the pre-Alembic create_schema() already have api_keys, identical to this.
    if not sa.inspect(op.get_bind()).has_table("api_keys"):
        _create_api_keys()
    _create_audit_records()
    op.create_table(
        "audit_stages",
        sa.Column("record_id", sa.String(36), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("stage_id", sa.String(100), nullable=False),
        sa.Column("type", sa.String(100), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.Column("cost_usd", sa.Float(), nullable=False),
        sa.Column("decision", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["record_id"], ["audit_records.id"], ondelete="CASCADE",
                                name=op.f("fk_audit_stages_record_id_audit_records")),
        sa.PrimaryKeyConstraint("record_id", "position", name=op.f("pk_audit_stages")),
    )
    op.create_table(
        "audit_checkpoints",
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("head_hash", sa.String(64), nullable=False),
        sa.Column("signature", sa.String(128), nullable=False),
        sa.Column("algorithm", sa.String(32), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_audit_checkpoints")),
    )
    head = op.create_table(
        "audit_chain_head",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_chain_head")),
    )
    # The one row every writer locks; it exists from the start so that no writer has to create it.
    op.bulk_insert(head, [{"id": 1, "seq": 0, "hash": GENESIS_HASH}])
    op.create_table(
        "audit_access_log",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", _utc(), nullable=False),
        sa.Column("key_id", sa.String(64), nullable=True),
        sa.Column("role", sa.String(16), nullable=True),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("query", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_access_log")),
    )
    op.create_index(op.f("ix_audit_access_log_at"), "audit_access_log", ["at"])


def downgrade() -> None:
    op.drop_table("audit_access_log")
    op.drop_table("audit_chain_head")
    op.drop_table("audit_checkpoints")
    op.drop_table("audit_stages")
    op.drop_table("audit_records")
    op.drop_table("api_keys")


def _create_api_keys() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(12), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("revoked_at", _utc(), nullable=True),
        sa.Column("last_used_at", _utc(), nullable=True),
        sa.CheckConstraint("role IN ('caller', 'auditor', 'admin')", name=op.f("ck_api_keys_role")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    )


_RECORD_INDEXES = ("cost_usd", "duration_ms", "key_id", "model", "policy_action", "received_at", "request_id",
                   "spec_sha256", "status")


def _create_audit_records() -> None:
    strings = {"kind": 16, "key_id": 64, "role": 16, "client_addr": 64, "pipeline": 200, "pipeline_version": 64,
               "spec_sha256": 64, "model": 200, "weights_hash": 64, "policy_action": 32, "policy_categories": 500,
               "status": 16, "finish_reason": 32, "error_type": 100, "content_mode": 16, "request_id": 64,
               "trace_id": 64}
    nullable = {"first_token_at", "ttft_ms", "key_id", "role", "client_addr", "model", "weights_hash", "route",
                "retrieval", "policy_action", "finish_reason", "http_status", "error_type", "request_id",
                "trace_id", "pruned"}
    types: dict[str, sa.types.TypeEngine] = {
        "id": sa.String(36), "seq": sa.BigInteger(), "prev_hash": sa.String(64), "hash": sa.String(64),
        "received_at": _utc(), "first_token_at": _utc(), "completed_at": _utc(), "duration_ms": sa.Float(),
        "ttft_ms": sa.Float(), "params": sa.JSON(), "input_tokens": sa.Integer(), "output_tokens": sa.Integer(),
        "cost_usd": sa.Float(), "route": sa.JSON(), "retrieval": sa.JSON(), "policy": sa.JSON(),
        "http_status": sa.Integer(), "input_content": sa.Text(), "output_content": sa.Text(), "pruned": sa.JSON(),
        "legal_hold": sa.Boolean(),
    }
    types.update({name: sa.String(length) for name, length in strings.items()})
    order = ("id", "seq", "prev_hash", "hash", "kind", "received_at", "first_token_at", "completed_at",
             "duration_ms", "ttft_ms", "key_id", "role", "client_addr", "pipeline", "pipeline_version",
             "spec_sha256", "model", "weights_hash", "params", "input_tokens", "output_tokens", "cost_usd", "route",
             "retrieval", "policy", "policy_action", "policy_categories", "status", "finish_reason", "http_status",
             "error_type", "content_mode", "input_content", "output_content", "request_id", "trace_id", "pruned",
             "legal_hold")
    op.create_table(
        "audit_records",
        *(sa.Column(name, types[name], nullable=name in nullable) for name in order),
        sa.CheckConstraint("status IN ('ok', 'denied', 'failed', 'disconnected')",
                           name=op.f("ck_audit_records_status")),
        sa.CheckConstraint("content_mode IN ('full', 'redacted', 'hash')", name=op.f("ck_audit_records_content_mode")),
        sa.CheckConstraint("kind IN ('record', 'prune')", name=op.f("ck_audit_records_kind")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_records")),
        sa.UniqueConstraint("seq", name=op.f("uq_audit_records_seq")),
    )
    for column in _RECORD_INDEXES:
        op.create_index(op.f(f"ix_audit_records_{column}"), "audit_records", [column])
    op.create_index("ix_audit_records_pipeline_received_at", "audit_records", ["pipeline", "received_at"])
