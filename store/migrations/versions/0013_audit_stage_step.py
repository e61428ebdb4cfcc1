"""Audit stage rows keep their step (attempt, start, tokens, skip reason, hashes and, with content full, the
values); audit_append() stores it.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-09

The column is chained only when set (store/audit/chain.py), so the stage rows written before this revision
keep their records' hashes. The PostgreSQL function is revision 0012's, with ``step`` added to the stage
rows it inserts. Going down drops the column and what it holds: a record chained with steps then no longer
verifies (its hash covered them), as with 0012's columns.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# audit_append() as revision 0012 left it, copied here: a released revision is frozen text, so it imports
# no other one. *new* adds this revision's column to the stage rows it inserts.
_JSON_NULL = ("route", "retrieval", "pruned")
_RECORD_COLUMNS = (
    "id", "seq", "prev_hash", "hash", "kind", "received_at", "first_token_at", "completed_at", "duration_ms",
    "ttft_ms", "key_id", "role", "client_addr", "pipeline", "pipeline_version", "spec_sha256", "model",
    "weights_hash", "params", "input_tokens", "output_tokens", "cost_usd", "route", "retrieval", "policy",
    "policy_action", "policy_categories", "status", "finish_reason", "http_status", "error_type", "content_mode",
    "input_content", "output_content", "request_id", "trace_id", "pruned", "legal_hold", "tags", "subject_hash",
)
_STAGE_COLUMNS = ("record_id", "position", "stage_id", "type", "status", "duration_ms", "cost_usd", "decision")
# A stage's decision is JSON null when it decided nothing (what the locking append stores); its step is SQL
# NULL when it has none (the model's none_as_null), as in the rows written before this revision.
_STAGE_VALUES = ("s.record_id", "s.position", "s.stage_id", "s.type", "s.status", "s.duration_ms", "s.cost_usd",
                 "COALESCE(s.decision, 'null'::json)")


def _record_value(column: str) -> str:
    if column == "legal_hold":
        return "false"  # a new record is never on hold; holds are set afterwards
    if column in _JSON_NULL:
        return f"COALESCE(r.{column}, 'null'::json)"
    return f"r.{column}"


def _function(new: bool) -> str:
    stage_columns = (*_STAGE_COLUMNS, "step") if new else _STAGE_COLUMNS
    stage_values = (*_STAGE_VALUES, "s.step") if new else _STAGE_VALUES
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
        INSERT INTO audit_stages ({", ".join(stage_columns)})
        SELECT {", ".join(stage_values)}
          FROM json_populate_recordset(NULL::audit_stages, stages) AS s;
    END IF;
    IF checkpoints IS NOT NULL THEN
        INSERT INTO audit_checkpoints (seq, head_hash, signature, algorithm, key_id, created_at)
        SELECT c.seq, c.head_hash, c.signature, c.algorithm, COALESCE(c.key_id, ''), c.created_at
          FROM json_populate_recordset(NULL::audit_checkpoints, checkpoints) AS c;
    END IF;
    RETURN QUERY SELECT true, new_seq, new_hash;
END
$$
"""


def upgrade() -> None:
    op.add_column("audit_stages", sa.Column("step", sa.JSON(), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_function(new=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # Before the column goes: the function's INSERT names it.
        op.execute(_function(new=False))
    # ALTER TABLE ... DROP COLUMN on both (SQLite since 3.35): no copy of the table.
    op.execute("ALTER TABLE audit_stages DROP COLUMN step")
