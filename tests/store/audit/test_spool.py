"""Nothing lost: records spool to a local file while the database is away and replay exactly once.

An outage is a store pointed at an engine whose connections fail (a closed
port); recovery points it back at the real database.
"""

from __future__ import annotations

import json
import shutil

import pytest
import sqlalchemy as sa

import store.audit.writer
from store.audit import AuditStore, AuditUnavailable
from store.engine import make_engine
from tests.store.audit.test_store import make_record

# Fixtures shared with the chain tests: the same engines, SQLite and PostgreSQL.


@pytest.fixture
def dead_engine():
    dead = make_engine("postgresql://postgres@127.0.0.1:1/nothing?connect_timeout=2")
    yield dead
    dead.dispose()


@pytest.fixture
def audit(engine, tmp_path) -> AuditStore:
    return AuditStore(engine, spool_path=tmp_path / "spool" / "audit.jsonl")


def seqs(engine: sa.Engine) -> list[tuple[int, str]]:
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(sa.text("SELECT seq, request_id FROM audit_records ORDER BY seq"))]


def go_down(audit: AuditStore, dead_engine: sa.Engine) -> sa.Engine:
    real, audit.engine = audit.engine, dead_engine
    return real


def test_an_outage_spools_and_replay_chains_in_order(audit, dead_engine, monkeypatch):
    monkeypatch.setattr(store.audit.writer, "RETRY_AFTER_S", 0.0)
    audit.write(make_record(0))
    real = go_down(audit, dead_engine)
    ids = [audit.write(make_record(i)) for i in (1, 2, 3)]
    lines = audit.writer._spool.path.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ids
    assert all("seq" not in json.loads(line) for line in lines)
    audit.engine = real
    audit.write(make_record(4))  # replays the spool first: spooled records happened first
    assert seqs(real) == [(i + 1, f"req-{i}") for i in range(5)]
    assert audit.writer._spool.is_empty()
    assert audit.get(ids[0])["stages"][1]["stage_id"] == "gen"
    assert audit.verify().ok


def test_replay_spool_is_exactly_once_even_after_a_crash_before_truncation(audit, dead_engine, tmp_path):
    real = go_down(audit, dead_engine)
    for i in range(4):
        audit.write(make_record(i))
    audit.engine = real
    saved = tmp_path / "copy"
    shutil.copy(audit.writer._spool.path, saved)
    assert audit.replay_spool() == 4
    shutil.copy(saved, audit.writer._spool.path)  # as if the process died after the commit, before truncating
    assert audit.replay_spool() == 0
    assert audit.replay_spool() == 0
    assert [seq for seq, _ in seqs(real)] == [1, 2, 3, 4]
    assert audit.verify().ok


def test_a_partly_replayed_spool_finishes_without_duplicates(audit, dead_engine):
    real = go_down(audit, dead_engine)
    ids = [audit.write(make_record(i)) for i in range(3)]
    audit.engine = real
    audit.write_many([make_record(0, id=ids[0])])  # the first one made it in before a crash
    assert audit.replay_spool() == 2
    assert [request for _, request in seqs(real)] == ["req-0", "req-1", "req-2"]


def test_the_backoff_sends_writes_straight_to_the_spool(audit, dead_engine, monkeypatch):
    real = go_down(audit, dead_engine)
    audit.write(make_record(0))
    calls = []
    monkeypatch.setattr(audit.writer, "_append", lambda *a, **k: calls.append(1))
    audit.engine = real
    audit.write(make_record(1))  # within RETRY_AFTER_S of the failure: no database attempt
    assert calls == []
    assert len(audit.writer._spool.path.read_text().splitlines()) == 2


def test_a_locked_database_spools_too(audit, monkeypatch):
    def locked(*args, **kwargs):
        raise sa.exc.OperationalError("INSERT", {}, Exception("database is locked"))

    monkeypatch.setattr(audit.writer, "_append", locked)
    record_id = audit.write(make_record(0))
    monkeypatch.undo()
    assert audit.replay_spool() == 1
    assert audit.get(record_id) is not None


def test_required_mode_raises_when_nothing_can_take_the_record(engine, dead_engine, tmp_path):
    (tmp_path / "spool-is-a-folder").mkdir()
    audit = AuditStore(dead_engine, spool_path=tmp_path / "spool-is-a-folder", mode="required")
    assert audit.is_durable()  # nothing has failed yet
    with pytest.raises(AuditUnavailable):
        audit.write(make_record(0))
    assert not audit.is_durable()
    lenient = AuditStore(dead_engine, spool_path=tmp_path / "spool-is-a-folder")
    assert lenient.write(make_record(1))  # best_effort: logged as lost, the request goes on


def test_required_mode_is_durable_with_a_spool(dead_engine, tmp_path):
    audit = AuditStore(dead_engine, spool_path=tmp_path / "audit.jsonl", mode="required")
    audit.write(make_record(0))
    assert audit.is_durable()
    assert len(audit.writer._spool.path.read_text().splitlines()) == 1


def test_torn_and_unreadable_lines_do_not_block_replay(audit, dead_engine):
    real = go_down(audit, dead_engine)
    audit.write(make_record(0))
    audit.engine = real
    with open(audit.writer._spool.path, "a") as spool:
        spool.write("not json\n")
        spool.write(json.dumps({"id": "x", "status": "weird"}) + "\n")
        spool.write('{"id": "torn", "pipel')
    assert audit.replay_spool() == 1
    rejected = audit.writer._spool.path.with_name("audit.jsonl.rejected").read_text().splitlines()
    assert len(rejected) == 2
    assert audit.writer._spool.is_empty()


@pytest.mark.parametrize("mode", ["", "always"])
def test_bad_options_are_refused(engine, tmp_path, mode):
    with pytest.raises(ValueError):
        AuditStore(engine, spool_path=tmp_path / "s", mode=mode)
    with pytest.raises(ValueError):
        AuditStore(engine, spool_path=tmp_path / "s", checkpoint_every=0)


def test_an_unreadable_spool_does_not_cost_the_record_in_hand(audit, dead_engine, monkeypatch, caplog):
    monkeypatch.setattr(store.audit.writer, "RETRY_AFTER_S", 0.0)
    real = go_down(audit, dead_engine)
    spooled = audit.write(make_record(1))
    audit.engine = real

    def unreadable():
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(audit.writer._spool, "claimed", unreadable)
    written = audit.write(make_record(2))
    assert audit.get(written) is not None  # written, though the spool could not be replayed first
    assert "could not be replayed" in caplog.text
    monkeypatch.undo()
    assert audit.replay_spool() == 1  # the spooled record is still there for later
    assert audit.get(spooled) is not None and audit.verify().ok
