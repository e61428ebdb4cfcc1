"""AuditMaintenance alone (store/audit/maintenance.py): holds and prunes what an AuditWriter wrote.

SQLite in tmp_path and, marked ``integration``, PostgreSQL, where the writer's
one-round-trip append must notice the head that a prune elsewhere moved.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa

from store.audit import AuditFilters, AuditMaintenance, AuditReader, AuditWriter
from tests.store.audit.test_store import T0, make_record

KEY = b"k" * 32
#: Records 0..4 are older than 30 days at this time, 5..9 newer.
NOW = T0 + timedelta(days=30, minutes=5)


@pytest.fixture
def writer(engine, tmp_path) -> Iterator[AuditWriter]:
    """A writer that has chained ten records: even ones of pipeline support, odd ones of rag."""
    writer = AuditWriter(engine, spool_path=tmp_path / "audit.spool", checkpoint_key=KEY, checkpoint_every=11)
    for i in range(10):
        writer.write(make_record(i))
    yield writer
    writer.close()


def request_ids(engine: sa.Engine) -> list[str]:
    return sorted(r["request_id"] for r in AuditReader(engine).query(AuditFilters(), limit=100).records)


def test_maintenance_alone_holds_and_prunes_and_the_chain_still_verifies(engine, writer):
    maintenance = AuditMaintenance(engine)
    [held] = [r["id"] for r in AuditReader(engine).query(AuditFilters(), limit=100).records
              if r["request_id"] == "req-2"]
    assert maintenance.set_hold(record_ids=[held]) == 1
    assert maintenance.set_hold(pipeline="rag") == 5
    report = maintenance.prune({"support": 30, "rag": 30}, now=NOW)
    assert report.deleted == 2  # req-0 and req-4: req-2 is held, and so is all of rag
    assert request_ids(engine) == sorted(f"req-{i}" for i in range(10) if i not in (0, 4))
    assert AuditReader(engine).get(report.marker_id)["kind"] == "prune"
    assert AuditReader(engine).verify().ok
    assert maintenance.set_hold(pipeline="rag", on=False) == 5
    assert maintenance.prune({"rag": 30}, now=NOW).deleted == 2  # req-1 and req-3


def test_the_writer_goes_on_after_a_prune_by_another_object(engine, writer):
    AuditMaintenance(engine).prune({"support": 30}, now=NOW)
    writer.write(make_record(20))  # on PostgreSQL, onto a head its one-round-trip append did not see move
    report = AuditReader(engine).verify()
    assert report.ok and report.head_seq == 12


def test_a_prune_marker_on_a_checkpoint_seq_is_signed_with_the_maintenance_key(engine, writer):
    AuditMaintenance(engine, checkpoint_key=KEY, checkpoint_every=11).prune({"support": 30}, now=NOW)  # seq 11
    with engine.connect() as conn:
        assert list(conn.scalars(sa.text("SELECT seq FROM audit_checkpoints"))) == [11]
    assert AuditReader(engine, checkpoint_key=KEY).verify().ok


def test_maintenance_for_a_writer_prunes_under_the_writers_lock(engine, writer):
    maintenance = AuditMaintenance.for_writer(writer)
    reports = []
    pruning = threading.Thread(target=lambda: reports.append(maintenance.prune({"support": 30}, now=NOW)))
    with writer.chain.lock:
        pruning.start()
        pruning.join(0.2)
        assert pruning.is_alive() and not reports  # waiting for this process's writes
    pruning.join()
    assert reports[0].deleted == 3
    with engine.connect() as conn:  # its marker, seq 11, is signed with the writer's key
        assert list(conn.scalars(sa.text("SELECT seq FROM audit_checkpoints"))) == [11]
    assert AuditReader(engine, checkpoint_key=KEY).verify().ok


def test_maintenance_refuses_a_bad_retention_or_an_empty_hold(engine):
    maintenance = AuditMaintenance(engine)
    with pytest.raises(ValueError):
        maintenance.prune({"support": -1})
    with pytest.raises(ValueError):
        maintenance.set_hold()
    with pytest.raises(ValueError):
        AuditMaintenance(engine, checkpoint_every=0)
