"""AuditReader alone (store/audit/reader.py): it reads and verifies what an AuditWriter wrote, with no spool.

The reader gets its own engine on the same database, as a reviewer's tool in
another process would. SQLite in tmp_path and, marked ``integration``, PostgreSQL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from store.audit import AccessFilters, AuditFilters, AuditReader, AuditWriter
from store.engine import make_engine
from tests.store.audit.test_store import execute, kinds, make_record

KEY = b"k" * 32


@pytest.fixture
def written(engine, tmp_path) -> list[str]:
    """Seven records chained by a writer with a checkpoint key (checkpoints at seqs 3 and 6); their ids."""
    writer = AuditWriter(engine, spool_path=tmp_path / "audit.spool", checkpoint_key=KEY, checkpoint_every=3)
    ids = [writer.write(make_record(i)) for i in range(7)]
    writer.close()
    return ids


@pytest.fixture
def reader_engine(engine) -> Iterator[sa.Engine]:
    """Another engine on the writer's database."""
    other = make_engine(engine.url.render_as_string(hide_password=False))
    yield other
    other.dispose()


def test_a_reader_alone_reads_what_a_writer_wrote(written, reader_engine):
    reader = AuditReader(reader_engine)
    record = reader.get(written[2])
    assert record["request_id"] == "req-2" and [s["stage_id"] for s in record["stages"]] == ["guard", "gen"]
    page = reader.query(AuditFilters(pipeline="support"), sort="seq", limit=10)
    assert [r["request_id"] for r in page.records] == ["req-0", "req-2", "req-4", "req-6"]
    groups = {g["pipeline"]: g["count"] for g in reader.summary(AuditFilters(), "pipeline")}
    assert groups == {"support": 4, "rag": 3}
    lines = list(reader.export(AuditFilters(), "jsonl"))
    assert [json.loads(line)["id"] for line in lines] == written


def test_a_record_is_found_by_its_request_id_or_its_trace_id(written, reader_engine):
    reader = AuditReader(reader_engine)
    assert reader.find_id("req-3") == written[3]
    assert reader.find_id(f"{5:032x}") == written[5]  # a trace id: 32 hex digits
    assert reader.find_id("req-99") is None
    assert reader.find_id(f"{99:032x}") is None
    # What is not shaped like a trace id is never looked up as one.
    execute(reader_engine, "UPDATE audit_records SET trace_id = 'short' WHERE seq = 2")
    assert reader.find_id("short") is None


def test_a_reader_alone_verifies_the_chain_and_with_a_key_its_checkpoints(written, reader_engine):
    assert AuditReader(reader_engine).verify().ok  # no key: the chain only
    keyed = AuditReader(reader_engine, checkpoint_key=KEY)
    report = keyed.verify()
    assert report.ok and report.checked == 7 and report.head_seq == 7
    assert kinds(keyed.verify(checkpoint_key=b"other")) == ["bad_checkpoint", "bad_checkpoint"]
    execute(reader_engine, "UPDATE audit_records SET cost_usd = 99 WHERE seq = 5")
    assert [(f.kind, f.seq) for f in keyed.verify().findings] == [("modified", 5)]


def test_a_reader_keeps_the_access_log(reader_engine):
    reader = AuditReader(reader_engine)
    reader.log_access("key-1", "auditor", "query", {"pipeline": "support", "since": object()})
    reader.log_access("key-2", "admin", "verify", {})
    assert [(e["key_id"], e["action"]) for e in reader.access_log()] == [("key-2", "verify"), ("key-1", "query")]
    [entry] = reader.access(AccessFilters(key_id="key-1")).records
    assert entry["role"] == "auditor" and entry["query"]["pipeline"] == "support"
    assert isinstance(entry["query"]["since"], str)  # what JSON cannot hold is kept as its str()
