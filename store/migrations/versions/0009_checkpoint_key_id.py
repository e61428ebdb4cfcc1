"""Checkpoints name the key that signed them (Ed25519 key rotation); audit_append() stores it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# Revision 0004's audit_append(), copied here as it was: a released revision is frozen text, so it
# imports no other one. *new* adds key_id to the checkpoints it inserts; without it, this is 0004's.
_JSON_NULL = ("route", "retrieval", "pruned")
_RECORD_COLUMNS = (
    "id", "seq", "prev_hash", "hash", "kind", "received_at", "first_token_at", "completed_at", "duration_ms",
    "ttft_ms", "key_id", "role", "client_addr", "pipeline", "pipeline_version", "spec_sha256", "model",
    "weights_hash", "params", "input_tokens", "output_tokens", "cost_usd", "route", "retrieval", "policy",
    "policy_action", "policy_categories", "status", "finish_reason", "http_status", "error_type", "content_mode",
    "input_content", "output_content", "request_id", "trace_id", "pruned", "legal_hold",
)
_CHECKPOINT_COLUMNS = {
    False: ("seq, head_hash, signature, algorithm, created_at",
            "c.seq, c.head_hash, c.signature, c.algorithm, c.created_at"),
    True: ("seq, head_hash, signature, algorithm, key_id, created_at",
           "c.seq, c.head_hash, c.signature, c.algorithm, COALESCE(c.key_id, ''), c.created_at"),
}


def _record_value(column: str) -> str:
    if column == "legal_hold":
        return "false"  # a new record is never on hold; holds are set afterwards
    if column in _JSON_NULL:
        return f"COALESCE(r.{column}, 'null'::json)"
    return f"r.{column}"


def _function(new: bool) -> str:
    checkpoint_columns, checkpoint_values = _CHECKPOINT_COLUMNS[new]
    return f"""
CREATE OR REPLACE FUNCTION audit_append(expected_seq bigint, expected_hash text, new_seq bigint, new_hash text,
                             records json, stages json, checkpoints json)
RETURNS TABLE (appended boolean, head_seq bigint, head_hash text)
LANGUAGE plpgsql AS $$
BEGIN
    -- The compare-and-set. The row lock orders writers; a writer that waited for it
    -- re-checks the WHERE against the head that the other one committed, and misses.
    UPDATE audit_chain_head AS h SET seq = new_seq, hash = new_hash
     WHERE h.id = 1 AND h.seq = expected_seq AND h.hash = expected_hash;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, h.seq, h.hash::text FROM audit_chain_head AS h WHERE h.id = 1;
        RETURN;
    END IF;
    INSERT INTO audit_records ({", ".join(_RECORD_COLUMNS)})
    SELECT {", ".join(_record_value(column) for column in _RECORD_COLUMNS)}
      FROM json_populate_recordset(NULL::audit_records, records) AS r;
    IF stages IS NOT NULL THEN
        INSERT INTO audit_stages (record_id, position, stage_id, type, status, duration_ms, cost_usd, decision)
        SELECT s.record_id, s.position, s.stage_id, s.type, s.status, s.duration_ms, s.cost_usd,
               COALESCE(s.decision, 'null'::json)
          FROM json_populate_recordset(NULL::audit_stages, stages) AS s;
    END IF;
    IF checkpoints IS NOT NULL THEN
        INSERT INTO audit_checkpoints ({checkpoint_columns})
        SELECT {checkpoint_values}
          FROM json_populate_recordset(NULL::audit_checkpoints, checkpoints) AS c;
    END IF;
    RETURN QUERY SELECT true, new_seq, new_hash;
END
$$
"""


def upgrade() -> None:
    op.add_column("audit_checkpoints", sa.Column("key_id", sa.String(64), nullable=False, server_default=sa.text("''")))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_function(new=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_function(new=False))
    with op.batch_alter_table("audit_checkpoints") as batch:
        batch.drop_column("key_id")
