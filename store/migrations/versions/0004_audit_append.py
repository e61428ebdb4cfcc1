"""PostgreSQL: audit_append(), which chains records onto an expected head in one round trip.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

The function is store/audit/append.py's server half: under the chain head's
row lock it advances the head only if it is still the (seq, hash) the caller
hashed its records onto (a compare-and-set, so writers in several processes
still form one chain), then inserts the records, their stages and any
checkpoints, all in the caller's one statement (one transaction, committed
durably like any other). If the head has moved it writes nothing and returns
the head as it is. PL/pgSQL caches the plans of its statements per
connection, so nothing is planned per request. SQLite has no such function
and keeps the generic append (store/audit/locking_append.py), so this revision does nothing there.

The column lists are frozen here, as revisions must be: a later revision that
adds a column to audit_records or audit_stages replaces this function.
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# audit_records' columns, in the order of revision 0001, and how each is taken from the
# caller's JSON record. JSON null becomes SQL NULL in json_populate_recordset; the generic
# append (SQLAlchemy's JSON type) stores JSON 'null' for None, and so does this.
_JSON_NULL = ("route", "retrieval", "pruned")
_RECORD_COLUMNS = (
    "id", "seq", "prev_hash", "hash", "kind", "received_at", "first_token_at", "completed_at", "duration_ms",
    "ttft_ms", "key_id", "role", "client_addr", "pipeline", "pipeline_version", "spec_sha256", "model",
    "weights_hash", "params", "input_tokens", "output_tokens", "cost_usd", "route", "retrieval", "policy",
    "policy_action", "policy_categories", "status", "finish_reason", "http_status", "error_type", "content_mode",
    "input_content", "output_content", "request_id", "trace_id", "pruned", "legal_hold",
)


def _record_value(column: str) -> str:
    if column == "legal_hold":
        return "false"  # a new record is never on hold; holds are set afterwards
    if column in _JSON_NULL:
        return f"COALESCE(r.{column}, 'null'::json)"
    return f"r.{column}"


SIGNATURE = "audit_append(bigint, text, bigint, text, json, json, json)"

# json, not jsonb: json_populate_recordset hands each json column the caller's text as it
# is, so a float such as 1e+300 comes back as the float that was hashed (jsonb's numeric
# would print it as an integer). The stages come as a flat array of rows, record_id and
# position included: unnesting them from the records costs the server more than the
# client's encoding of them.
FUNCTION = f"""
CREATE FUNCTION audit_append(expected_seq bigint, expected_hash text, new_seq bigint, new_hash text,
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
        INSERT INTO audit_checkpoints (seq, head_hash, signature, algorithm, created_at)
        SELECT c.seq, c.head_hash, c.signature, c.algorithm, c.created_at
          FROM json_populate_recordset(NULL::audit_checkpoints, checkpoints) AS c;
    END IF;
    RETURN QUERY SELECT true, new_seq, new_hash;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION {SIGNATURE}")
