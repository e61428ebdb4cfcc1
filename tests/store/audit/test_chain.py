"""What the chain covers (store/audit/chain.py): the tags and the subject's keyed hash when a record has them,
and a record without them hashed exactly as before they were columns. On SQLite and, marked ``integration``,
on PostgreSQL (whose one-round-trip append stores them through ``audit_append()``)."""

from __future__ import annotations

import json

import pytest

from store.audit import AuditFilters, AuditStore
from store.audit.chain import canonical, normalize, record_hash
from store.db import utcnow
from tests.store.audit.test_store import T0, execute, kinds, make_record

#: The columns the chain covered before revision 0012 (tags, subject_hash): a record without those two must
#: hash over exactly these, or every record chained before would fail verification.
COLUMNS_BEFORE_0012 = (
    "id", "seq", "prev_hash", "kind", "received_at", "first_token_at", "completed_at", "duration_ms", "ttft_ms",
    "key_id", "role", "client_addr", "pipeline", "pipeline_version", "spec_sha256", "model", "weights_hash",
    "params", "input_tokens", "output_tokens", "cost_usd", "route", "retrieval", "policy", "policy_action",
    "policy_categories", "status", "finish_reason", "http_status", "error_type", "content_mode",
    "input_content", "output_content", "request_id", "trace_id", "pruned",
)
TAGS = json.dumps({"tier": "gold", "user": "alice"}, sort_keys=True, separators=(",", ":"))


@pytest.fixture
def audit(engine, tmp_path) -> AuditStore:
    return AuditStore(engine, spool_path=tmp_path / "audit.spool", checkpoint_key=b"k" * 32, checkpoint_every=5)


def test_a_record_without_tags_hashes_over_the_columns_it_always_had():
    row, stages = normalize(make_record(0), utcnow())
    row.update(seq=1, prev_hash="0" * 64)
    assert row["tags"] is None and row["subject_hash"] is None
    assert set(json.loads(canonical(row, stages))) == {*COLUMNS_BEFORE_0012, "stages"}
    assert set(json.loads(canonical({**row, "tags": TAGS, "subject_hash": "ab" * 32}, stages))) == \
        {*COLUMNS_BEFORE_0012, "tags", "subject_hash", "stages"}
    # The hash the code before revision 0012 gave this very record.
    fixed, _ = normalize(make_record(0, id="0190aaaa-0000-7000-8000-000000000000"), T0)
    assert record_hash("0" * 64, {**fixed, "seq": 1, "prev_hash": "0" * 64}, stages) == \
        "409b02e7f9301a9d30359506e837837e65499516b673fd9bc293cbf57b0406df"


def test_tags_and_the_subject_hash_are_kept_and_chained(engine, audit):
    audit.write(make_record(0))
    tagged = audit.write(make_record(1, tags=TAGS, subject_hash="ab" * 32))
    found = audit.get(tagged)
    assert found["tags"] == {"tier": "gold", "user": "alice"} and found["subject_hash"] == "ab" * 32
    assert audit.query(AuditFilters(), sort="seq").records[0]["tags"] is None
    assert audit.verify().ok
    execute(engine, "UPDATE audit_records SET tags = :tags WHERE seq = 2", tags=TAGS.replace("alice", "bob"))
    execute(engine, "UPDATE audit_records SET subject_hash = :h WHERE seq = 1", h="cd" * 32)
    assert kinds(audit.verify()) == ["modified", "modified"]
