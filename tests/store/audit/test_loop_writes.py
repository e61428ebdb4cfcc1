"""AuditStore.awrite_batch: the server sink's write, without a thread hop when nothing can wait.

PostgreSQL: one audit_append() call on an async connection of the store's own
(store/audit/append.AsyncOneTripAppender), safe next to blocking writers in
this and other processes, replaced when killed, and out of the way during an
outage. A SQLite file: the write on the loop (SqliteLoopWriter) unless the
database's lock is held elsewhere, when the thread path waits instead and the
loop goes on. All against the real databases.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import store.audit.writer
from store.audit import AuditStore, VerifyReport
from store.audit.append import SqliteLoopWriter
from store.engine import make_engine
from store.migrate import create_schema
from tests.store.audit.test_append import calls_to_audit_append, kill_connections, seqs
from tests.store.audit.test_store import make_record


@pytest.fixture
def dead_engine() -> Iterator[sa.Engine]:
    dead = make_engine("postgresql://postgres@127.0.0.1:1/nothing?connect_timeout=2")
    yield dead
    dead.dispose()


@pytest.fixture
def sqlite_file(tmp_path) -> Iterator[sa.Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'audit.db'}")
    create_schema(engine)
    yield engine
    engine.dispose()


# --- PostgreSQL ---------------------------------------------------------------------


@pytest.mark.integration
async def test_postgres_writes_go_through_the_async_connection(pg, tmp_path):
    audit = AuditStore(pg, spool_path=tmp_path / "s", checkpoint_key=b"k" * 32, checkpoint_every=3)
    blocking_calls = calls_to_audit_append(pg)
    ids = []
    for i in range(5):
        ids += await audit.awrite_batch([make_record(i)])
    ids += await audit.awrite_batch([make_record(i) for i in range(5, 8)])  # a group commit
    assert blocking_calls == []  # none through the engine: all on the loop's connection
    assert seqs(pg) == list(range(1, 9))
    assert audit.get(ids[-1])["seq"] == 8
    assert audit.verify() == VerifyReport(True, 8, 8, [])
    with pg.connect() as conn:
        assert list(conn.scalars(sa.text("SELECT seq FROM audit_checkpoints ORDER BY seq"))) == [3, 6]
    await audit.aclose()


@pytest.mark.integration
async def test_postgres_async_and_blocking_writers_still_form_one_chain(pg, other, tmp_path):
    mine, theirs = AuditStore(pg, spool_path=tmp_path / "a"), AuditStore(other, spool_path=tmp_path / "b")
    for i in range(6):
        await mine.awrite_batch([make_record(i)])
        theirs.write(make_record(100 + i))  # another process: every async write finds the head moved
        mine.write(make_record(200 + i))  # and this store's own blocking path
    assert seqs(pg) == list(range(1, 19))
    assert mine.verify() == VerifyReport(True, 18, 18, [])
    await mine.aclose()


@pytest.mark.integration
async def test_postgres_a_killed_async_connection_costs_no_record(pg, pg_url, tmp_path):
    audit = AuditStore(pg, spool_path=tmp_path / "s")
    await audit.awrite_batch([make_record(0)])
    blocking_calls = calls_to_audit_append(pg)
    assert kill_connections(pg_url) >= 1
    first = (await audit.awrite_batch([make_record(1)]))[0]  # fails on the loop, goes the blocking way
    assert len(blocking_calls) == 1
    second = (await audit.awrite_batch([make_record(2)]))[0]  # and back on a fresh async connection
    assert len(blocking_calls) == 1
    assert audit.writer._spool.is_empty()
    assert (audit.get(first)["seq"], audit.get(second)["seq"]) == (2, 3)
    assert audit.verify() == VerifyReport(True, 3, 3, [])
    await audit.aclose()


@pytest.mark.integration
async def test_postgres_an_outage_spools_and_the_next_write_replays(pg, dead_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(store.audit.writer, "RETRY_AFTER_S", 0.0)
    down = AuditStore(dead_engine, spool_path=tmp_path / "s")
    ids = [(await down.awrite_batch([make_record(i)]))[0] for i in range(3)]
    assert len(down.writer._spool.path.read_text().splitlines()) == 3
    up = AuditStore(pg, spool_path=tmp_path / "s")  # the database is back
    ids += await up.awrite_batch([make_record(3)])  # a spool to replay first: the blocking path does both
    assert [up.get(record_id)["seq"] for record_id in ids] == [1, 2, 3, 4]
    assert up.writer._spool.is_empty()
    assert up.verify().ok
    await up.aclose()
    await down.aclose()


@pytest.mark.integration
def test_postgres_the_async_connection_follows_the_event_loop(pg, tmp_path):
    audit = AuditStore(pg, spool_path=tmp_path / "s")
    blocking_calls = calls_to_audit_append(pg)
    for i in range(3):  # a new loop each time: the connection of the last one is left, not reused
        asyncio.run(audit.awrite_batch([make_record(i)]))
    assert blocking_calls == []  # each loop's write went out on that loop's own connection
    assert audit.verify() == VerifyReport(True, 3, 3, [])
    asyncio.run(audit.aclose())


# --- SQLite -------------------------------------------------------------------------


async def test_sqlite_writes_on_the_loop(sqlite_file, tmp_path):
    audit = AuditStore(sqlite_file, spool_path=tmp_path / "s")
    assert audit.writer._loop_writer is not None
    for i in range(4):
        await audit.awrite_batch([make_record(i)])
    assert audit.writer._loop_writer._writes == 4
    assert audit.verify() == VerifyReport(True, 4, 4, [])
    await audit.aclose()


async def test_sqlite_a_held_lock_sends_the_write_to_a_thread_and_the_loop_goes_on(sqlite_file, tmp_path):
    audit = AuditStore(sqlite_file, spool_path=tmp_path / "s")
    await audit.awrite_batch([make_record(0)])
    # What keeps the loop from waiting: its connection gives up on a held lock at once.
    loop_conn = audit.writer._loop_writer._conn.connection.driver_connection
    assert loop_conn.execute("PRAGMA busy_timeout").fetchone() == (0,)
    holder = sqlite3.connect(sqlite_file.url.database, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")  # another process's writer, holding the lock
    writing = asyncio.create_task(audit.awrite_batch([make_record(1)]))
    await asyncio.sleep(0.3)
    assert not writing.done()  # waiting for the lock, in a thread (on the loop it would have given up)
    holder.execute("COMMIT")
    record_id = (await writing)[0]
    holder.close()
    assert audit.writer._spool.is_empty()  # it waited for the lock rather than spooling
    assert audit.writer._loop_writer._writes == 1  # the first write only
    assert audit.get(record_id)["seq"] == 2
    await audit.awrite_batch([make_record(2)])  # and the next one on the loop again
    assert audit.writer._loop_writer._writes == 2
    assert audit.verify() == VerifyReport(True, 3, 3, [])
    await audit.aclose()


async def test_sqlite_checkpoints_run_in_a_thread(sqlite_file, tmp_path, monkeypatch):
    monkeypatch.setattr(SqliteLoopWriter, "CHECKPOINT_EVERY", 3)
    audit = AuditStore(sqlite_file, spool_path=tmp_path / "s")
    done = threading.Event()
    threads: list[str] = []
    real = SqliteLoopWriter._checkpoint

    def checkpoint(self: SqliteLoopWriter) -> None:
        threads.append(threading.current_thread().name)
        real(self)
        done.set()

    monkeypatch.setattr(SqliteLoopWriter, "_checkpoint", checkpoint)
    database = sqlite_file.url.database
    probe = sqlite3.connect(database)
    before, page_size = (probe.execute(f"PRAGMA {name}").fetchone()[0] for name in ("page_count", "page_size"))
    probe.close()
    for i in range(3):
        await audit.awrite_batch([make_record(i, input_content="x" * 20_000)])
    assert done.wait(10)
    assert threads == ["audit-wal-checkpoint"]
    with open(database, "rb") as main:  # the WAL's pages are in the main file now
        assert len(main.read()) > before * page_size
    assert audit.verify().ok
    await audit.aclose()


def test_in_memory_sqlite_has_no_loop_writer(tmp_path):
    engine = make_engine("sqlite://")
    create_schema(engine)
    assert AuditStore(engine, spool_path=tmp_path / "s").writer._loop_writer is None
    engine.dispose()
