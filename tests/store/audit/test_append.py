"""The one-round-trip append on PostgreSQL (store/audit/append.py, revision 0004's audit_append()).

All on the real PostgreSQL server (marked ``integration``): the function, its
compare-and-set against writers the store does not know about, the fallback
to the locking append, a connection killed under the writer, and what the
rows look like next to the locking append's.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from store.audit import AuditStore, VerifyReport
from store.audit.chain import json_line, normalize
from store.db import utcnow
from store.engine import make_engine
from store.migrate import current_revision, downgrade, upgrade
from tests.store.audit.test_store import make_record

pytestmark = pytest.mark.integration


def kill_connections(pg_url: str) -> int:
    """Terminate every other connection with *pg_url*'s application name (the store's); how many."""
    admin = make_engine(pg_url)
    try:
        with admin.connect() as conn:
            return conn.scalar(sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = current_setting('application_name') AND pid <> pg_backend_pid()"))
    finally:
        admin.dispose()


def calls_to_audit_append(engine: sa.Engine) -> list[str]:
    """Statements sent on *engine* that call audit_append(), collected as they go."""
    sent: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _seen(conn, cursor, statement, parameters, context, executemany):
        if "audit_append(" in statement and "to_regprocedure" not in statement:
            sent.append(statement)

    return sent


def seqs(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.scalars(sa.text("SELECT seq FROM audit_records ORDER BY seq")))


def test_the_revision_adds_and_drops_the_function(postgresql_url):
    engine = make_engine(postgresql_url)
    try:
        upgrade(engine)
        with engine.connect() as conn:
            exists = "SELECT to_regprocedure('audit_append(bigint, text, bigint, text, json, json, json)') IS NOT NULL"
            assert conn.scalar(sa.text(exists)) is True
        downgrade(engine, "0003")
        assert current_revision(engine) == "0003"
        with engine.connect() as conn:
            assert conn.scalar(sa.text(exists)) is False
        upgrade(engine)
        with engine.connect() as conn:
            assert conn.scalar(sa.text(exists)) is True
    finally:
        engine.dispose()


def test_each_write_is_one_call(pg, tmp_path):
    audit = AuditStore(pg, spool_path=tmp_path / "s", checkpoint_key=b"k" * 32, checkpoint_every=4)
    sent = calls_to_audit_append(pg)
    ids = [audit.write(make_record(i)) for i in range(9)]
    ids += audit.write_batch([make_record(i) for i in range(9, 14)])  # the server's group commit
    assert len(sent) == 10
    assert seqs(pg) == list(range(1, 15))
    assert [s["stage_id"] for s in audit.get(ids[-1])["stages"]] == ["guard", "gen"]
    assert audit.verify() == VerifyReport(True, 14, 14, [])
    with pg.connect() as conn:
        assert list(conn.scalars(sa.text("SELECT seq FROM audit_checkpoints ORDER BY seq"))) == [4, 8, 12]


def test_a_head_moved_by_another_writer_is_hashed_onto_again(pg, other, tmp_path):
    mine, theirs = AuditStore(pg, spool_path=tmp_path / "a"), AuditStore(other, spool_path=tmp_path / "b")
    sent = calls_to_audit_append(pg)
    mine.write(make_record(0))
    for i in range(1, 6):
        theirs.write(make_record(100 + i))
        mine.write(make_record(i))
    assert len(sent) == 1 + 2 * 5  # each of mine after one of theirs: a miss, then a hit
    assert seqs(pg) == list(range(1, 12))
    assert mine.verify() == VerifyReport(True, 11, 11, [])


def test_a_head_that_keeps_moving_falls_back_to_the_locking_append(pg, other, tmp_path):
    mine, theirs = AuditStore(pg, spool_path=tmp_path / "a"), AuditStore(other, spool_path=tmp_path / "b")
    mine.write(make_record(0))

    @sa.event.listens_for(pg, "before_cursor_execute")
    def _race(conn, cursor, statement, parameters, context, executemany):
        if "audit_append(" in statement and "to_regprocedure" not in statement:
            theirs.write(make_record(100))  # commits just before each of my calls reaches the server

    mine.write(make_record(1))
    sa.event.remove(pg, "before_cursor_execute", _race)
    assert seqs(pg) == [1, 2, 3, 4]  # mine, theirs, theirs, then mine through the locking append
    assert mine.verify() == VerifyReport(True, 4, 4, [])
    mine.write(make_record(2))  # and back on the one-call path, from the head the locking append left
    assert mine.verify() == VerifyReport(True, 5, 5, [])


def test_a_connection_killed_between_writes_is_replaced(pg, pg_url, tmp_path):
    audit = AuditStore(pg, spool_path=tmp_path / "s")
    audit.write(make_record(0))
    assert kill_connections(pg_url) >= 1
    record_id = audit.write(make_record(1))
    assert audit.writer._spool.is_empty()  # written to the database, on a fresh connection
    assert audit.get(record_id)["seq"] == 2
    assert audit.verify().ok


def test_a_duplicate_id_is_stored_once(pg, tmp_path):
    audit = AuditStore(pg, spool_path=tmp_path / "s")
    given = str(uuid.uuid4())
    records = [make_record(1), make_record(2, id=given), make_record(3)]
    audit.write(make_record(0, id=given))
    assert audit.write_batch(records)[1] == given  # the batch fails on it, then goes one by one
    assert seqs(pg) == [1, 2, 3]
    assert audit.verify().ok


def test_rows_look_as_the_locking_append_writes_them(pg, tmp_path):
    one_call = AuditStore(pg, spool_path=tmp_path / "s")
    first = one_call.write(make_record(0, route=None, retrieval=None))
    spooled = normalize(make_record(0, route=None, retrieval=None), utcnow())
    one_call.writer._spool.append(json_line(*spooled))
    assert one_call.replay_spool() == 1  # replay goes through the locking append
    second = spooled[0]["id"]
    query = sa.text("SELECT route IS NULL, route::text, retrieval::text, pruned::text, legal_hold, received_at "
                    "FROM audit_records WHERE id = :id")
    stage_query = sa.text("SELECT position, decision IS NULL, decision::text FROM audit_stages "
                          "WHERE record_id = :id ORDER BY position")
    with pg.connect() as conn:
        rows = [conn.execute(query, {"id": record_id}).one() for record_id in (first, second)]
        stages = [conn.execute(stage_query, {"id": record_id}).all() for record_id in (first, second)]
    assert rows[0][:5] == rows[1][:5] == (False, "null", "null", "null", False)
    assert rows[0].received_at.utcoffset() is not None
    assert [(p, is_null) for p, is_null, _ in stages[0]] == [(p, is_null) for p, is_null, _ in stages[1]]
    assert stages[0][1][2] == "null"
    assert one_call.get(first)["stages"] == one_call.get(second)["stages"]


def test_without_the_function_the_locking_append_writes(pg, tmp_path):
    # A database without the function (as before revision 0004), its tables as the models have them.
    with pg.begin() as conn:
        conn.execute(sa.text("DROP FUNCTION audit_append(bigint, text, bigint, text, json, json, json)"))
    audit = AuditStore(pg, spool_path=tmp_path / "s")
    sent = calls_to_audit_append(pg)
    for i in range(3):
        audit.write(make_record(i))
    assert sent == []
    assert pg.pool.checkedout() == 0  # no connection held for a path it does not take
    assert audit.verify() == VerifyReport(True, 3, 3, [])


def test_close_gives_the_connection_back(pg, tmp_path):
    audit = AuditStore(pg, spool_path=tmp_path / "s")
    audit.write(make_record(0))
    assert pg.pool.checkedout() == 1
    audit.close()
    assert pg.pool.checkedout() == 0
    audit.write(make_record(1))  # and takes one again when it next writes
    pg.dispose()  # which closes it too
    assert audit.verify().ok
