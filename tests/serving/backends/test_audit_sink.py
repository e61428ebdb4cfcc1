"""StoreSink: group commit (records that arrive together share a transaction), and write-behind through the journal."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import sqlalchemy as sa

from serving.backends import audit_sink
from serving.backends.audit_sink import StoreSink
from store.audit import AuditFilters, AuditStore, AuditUnavailable, Journal, leftover_journals
from store.audit import journal as audit_journal


class _Batches:
    """Records each batch's size; stands in for the store in this unit test of the sink."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    async def awrite_batch(self, records: list[dict[str, Any]]) -> list[str]:
        self.sizes.append(len(records))
        await asyncio.sleep(0.01)  # a commit takes a while
        return [str(i) for i in range(len(records))]


async def test_records_arriving_during_a_commit_go_together_in_the_next():
    store = _Batches()
    sink = StoreSink(store)  # type: ignore[arg-type]

    async def later() -> None:
        await asyncio.sleep(0.005)  # during the first commit
        await sink.write({"status": "ok"})

    await asyncio.gather(sink.write({"status": "ok"}), *(later() for _ in range(5)))
    assert store.sizes == [1, 5]


async def test_every_record_of_a_burst_lands_in_one_chain(tmp_path):
    from store.engine import make_engine
    from store.migrate import create_schema

    database = make_engine(f"sqlite:///{tmp_path / 'audit.db'}")
    create_schema(database)
    store = AuditStore(database, spool_path=tmp_path / "spool.jsonl")
    sink = StoreSink(store)
    await asyncio.gather(*(sink.write({"request_id": f"r{i}", "pipeline": "chat", "status": "ok"})
                           for i in range(20)))
    report = store.verify()
    assert report.ok and report.checked == 20
    page = store.query(AuditFilters(pipeline="chat"), limit=50)
    assert sorted(r["request_id"] for r in page.records) == sorted(f"r{i}" for i in range(20))


# -- write-behind through the journal (the server's default) ------------------------------------------


class _Held:
    """A store whose writes wait until released, keeping what it was given; can be told to refuse."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.release = asyncio.Event()
        self.refuse = False

    async def awrite_items(self, items: list[Any], strict: bool = False) -> None:
        await self.release.wait()
        if self.refuse:
            raise AuditUnavailable("the database is away and the spool is full")
        self.items += items

    async def aclose(self) -> None:
        pass


def _journal_lines(path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_write_returns_once_its_record_is_journaled_and_is_chained_after(tmp_path):
    store, journal = _Held(), Journal.open(tmp_path / "audit-journal")
    sink = StoreSink(store, journal)  # type: ignore[arg-type]
    await asyncio.gather(*(sink.write({"request_id": f"r{i}", "pipeline": "chat", "status": "ok"})
                           for i in range(3)))
    # Answered: the records are on disk, and not yet in the store.
    assert [line["request_id"] for line in _journal_lines(journal.path)] == ["r0", "r1", "r2"]
    assert store.items == [] and not await sink.flushed(timeout=0.05)
    store.release.set()
    assert await sink.flushed(timeout=5)
    assert [row["request_id"] for row, _ in store.items] == ["r0", "r1", "r2"]
    # All chained: emptied, by a worker thread right after (flushed() does not wait for that).
    async def emptied() -> None:
        while journal.path.stat().st_size:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(emptied(), 5)
    await sink.aclose()
    assert not journal.path.exists()


async def test_a_batch_journaled_while_the_last_is_being_chained_keeps_it_in_the_file(tmp_path):
    """The next batch empties the journal first only when everything in it is chained."""
    store, journal = _Held(), Journal.open(tmp_path / "audit-journal")
    sink = StoreSink(store, journal)  # type: ignore[arg-type]
    await sink.write({"request_id": "r0", "pipeline": "chat", "status": "ok"})
    await sink.write({"request_id": "r1", "pipeline": "chat", "status": "ok"})  # r0 is not chained yet
    assert [line["request_id"] for line in _journal_lines(journal.path)] == ["r0", "r1"]
    store.release.set()
    assert await sink.flushed(timeout=5)
    await sink.write({"request_id": "r2", "pipeline": "chat", "status": "ok"})  # all chained: emptied first
    assert [line["request_id"] for line in _journal_lines(journal.path)] == ["r2"]
    await sink.aclose()


async def test_a_journal_that_cannot_be_emptied_still_lets_readers_and_writers_on(tmp_path, monkeypatch):
    """Emptying the chained journal failing (EIO) is logged; it neither stops the chaining nor leaves a
    reader waiting in flushed() for a notice that never comes."""
    store, journal = _Held(), Journal.open(tmp_path / "audit-journal")

    def broken(appends: int | None = None) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(journal, "truncate", broken)
    monkeypatch.setattr(audit_sink, "DRAIN_DELAY_S", 0.0)
    sink = StoreSink(store, journal)  # type: ignore[arg-type]
    await sink.write({"request_id": "r0", "pipeline": "chat", "status": "ok"})
    reader = asyncio.create_task(sink.flushed(timeout=2))  # waiting before r0 is chained
    await asyncio.sleep(0.01)
    store.release.set()
    assert await reader
    await sink.write({"request_id": "r1", "pipeline": "chat", "status": "ok"})  # emptied first, by the append
    assert await sink.flushed(timeout=2)
    assert [row["request_id"] for row, _ in store.items] == ["r0", "r1"]
    assert [line["request_id"] for line in _journal_lines(journal.path)] == ["r1"]
    monkeypatch.undo()
    await sink.aclose()


async def test_records_the_store_refuses_stay_journaled_and_a_restart_chains_them_once(tmp_path, monkeypatch):
    from store.engine import make_engine
    from store.migrate import create_schema

    monkeypatch.setattr(audit_sink, "DRAIN_RETRY_S", 0.01)
    prefix = tmp_path / "audit-journal"
    held = _Held()
    held.refuse = True
    held.release.set()
    sink = StoreSink(held, Journal.open(prefix))  # type: ignore[arg-type]
    await asyncio.gather(*(sink.write({"request_id": f"r{i}", "pipeline": "chat", "status": "ok"})
                           for i in range(4)))
    await sink.aclose(timeout=0.1)  # shutdown while the store still refuses: the journal stays
    (left,) = leftover_journals(prefix)
    assert len(_journal_lines(left)) == 4
    # The next start: a real store chains them, and a second replay of the same lines adds nothing.
    database = make_engine(f"sqlite:///{tmp_path / 'audit.db'}")
    create_schema(database)
    store = AuditStore(database, spool_path=tmp_path / "spool.jsonl")
    copy = left.with_name("audit-journal.1.jsonl")
    copy.write_text(left.read_text())
    assert store.replay_file(left) == 4 and not left.exists()
    assert store.replay_file(copy) == 0
    report = store.verify()
    assert report.ok and report.checked == 4
    page = store.query(AuditFilters(pipeline="chat"), limit=50)
    assert sorted(r["request_id"] for r in page.records) == ["r0", "r1", "r2", "r3"]


def test_a_running_process_journal_is_not_a_leftover(tmp_path):
    prefix = tmp_path / "audit-journal"
    mine = Journal.open(prefix)
    mine.append(['{"id": "x"}\n'])
    dead = tmp_path / "audit-journal.999999999-0badf00d.jsonl"  # no process holds its lock
    dead.write_text('{"id": "y"}\n')
    (tmp_path / "audit-journal.notes.jsonl").write_text("not a journal\n")
    assert leftover_journals(prefix) == [dead]
    mine.close()
    assert mine.path.exists()  # not empty: kept for the next start
    assert sorted(leftover_journals(prefix)) == sorted([dead, mine.path])


async def test_when_the_journal_cannot_take_a_record_it_is_chained_before_the_answer(tmp_path, monkeypatch):
    store, journal = _Held(), Journal.open(tmp_path / "audit-journal")
    store.release.set()

    def full(lines: list[str], empty_first: bool = False) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal, "append", full)
    sink = StoreSink(store, journal)  # type: ignore[arg-type]
    await sink.write({"request_id": "r0", "pipeline": "chat", "status": "ok"})
    assert [row["request_id"] for row, _ in store.items] == ["r0"]  # before write returned
    await sink.aclose()


async def test_writes_arriving_while_the_journal_fails_are_chained_directly_too(tmp_path, monkeypatch):
    """The batch that found the journal full waits for the records journaled before it, not for the writes
    that came in meanwhile (they wait for it: that was a 10 s stall, then an error for every one)."""
    store, journal = _Held(), Journal.open(tmp_path / "audit-journal")
    store.release.set()

    def full(lines: list[str], empty_first: bool = False) -> None:
        time.sleep(0.05)  # the write a full disk refuses, in its worker thread
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal, "append", full)
    sink = StoreSink(store, journal)  # type: ignore[arg-type]

    async def later(i: int) -> None:
        await asyncio.sleep(0.01)  # during the first batch's failing append
        await sink.write({"request_id": f"r{i}", "pipeline": "chat", "status": "ok"})

    await asyncio.wait_for(asyncio.gather(sink.write({"request_id": "r0", "pipeline": "chat", "status": "ok"}),
                                          later(1), later(2)), 5)
    assert [row["request_id"] for row, _ in store.items] == ["r0", "r1", "r2"]
    await sink.aclose()


async def test_a_malformed_record_fails_its_own_write_only(tmp_path):
    store, journal = _Held(), Journal.open(tmp_path / "audit-journal")
    store.release.set()
    sink = StoreSink(store, journal)  # type: ignore[arg-type]
    good = asyncio.create_task(sink.write({"request_id": "r0", "pipeline": "chat", "status": "ok"}))
    bad = asyncio.create_task(sink.write({"request_id": "r1", "status": "ok", "no_such_field": 1}))
    results = await asyncio.gather(good, bad, return_exceptions=True)
    assert results[0] is None
    assert isinstance(results[1], ValueError) and "unknown audit record field" in str(results[1])
    assert await sink.flushed(timeout=5)
    assert [row["request_id"] for row, _ in store.items] == ["r0"]
    await sink.aclose()


async def test_journaled_records_are_never_dropped_when_neither_the_database_nor_the_spool_takes_them(
        tmp_path, monkeypatch):
    from store.engine import make_engine

    monkeypatch.setattr(audit_sink, "DRAIN_RETRY_S", 0.01)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    # best_effort would log such records as lost; journaled ones are kept and retried instead.
    store = AuditStore(make_engine(f"sqlite:///{tmp_path}/no/such/folder/audit.db"),
                       spool_path=blocked / "spool.jsonl", mode="best_effort")
    journal = Journal.open(tmp_path / "audit-journal")
    sink = StoreSink(store, journal)
    await sink.write({"request_id": "r0", "pipeline": "chat", "status": "ok"})
    assert not await sink.flushed(timeout=0.3)
    assert [line["request_id"] for line in _journal_lines(journal.path)] == ["r0"]
    await sink.aclose(timeout=0.1)
    assert leftover_journals(tmp_path / "audit-journal") == [journal.path]


class _Picky(_Held):
    """Refuses (not for want of a database) any batch holding the record ``bad``."""

    async def awrite_items(self, items: list[Any], strict: bool = False) -> None:
        if any(row["request_id"] == "bad" for row, _ in items):
            raise sa.exc.DataError("INSERT INTO audit_records ...", {},
                                   Exception("value too long for type character varying(64)"))
        self.items += items


async def test_a_record_the_store_refuses_for_good_is_set_aside_and_the_rest_are_chained(tmp_path):
    store, journal = _Picky(), Journal.open(tmp_path / "audit-journal")
    sink = StoreSink(store, journal)  # type: ignore[arg-type]
    await asyncio.gather(*(sink.write({"request_id": rid, "pipeline": "chat", "status": "ok"})
                           for rid in ("r0", "bad", "r1")))
    assert await sink.flushed(timeout=5)
    assert [row["request_id"] for row, _ in store.items] == ["r0", "r1"]
    rejected = journal.path.with_name(journal.path.name + ".rejected")
    assert [json.loads(line)["request_id"] for line in rejected.read_text().splitlines()] == ["bad"]
    await sink.aclose()


def test_a_failed_append_leaves_no_torn_line(tmp_path, monkeypatch):
    journal = Journal.open(tmp_path / "audit-journal")
    journal.append(['{"id": "a"}\n'])

    def no_sync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(audit_journal.os, "fdatasync", no_sync)
    with pytest.raises(OSError, match="Input/output"):
        journal.append(['{"id": "b"}\n'])
    assert journal.path.read_text() == '{"id": "a"}\n'


def test_where_cutting_a_failed_append_back_fails_the_journal_knows_its_real_size(tmp_path, monkeypatch):
    """A later failed append cuts back to the true end, never into an answered batch; a truncate empties it."""
    journal = Journal.open(tmp_path / "audit-journal")
    journal.append(['{"id": "a"}\n'])

    def fail(*args: object) -> None:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patched:
        patched.setattr(audit_journal.os, "fdatasync", fail)
        patched.setattr(audit_journal.os, "ftruncate", fail)
        with pytest.raises(OSError):
            journal.append(['{"id": "b"}\n'])
    assert journal.size() == journal.path.stat().st_size == len('{"id": "a"}\n{"id": "b"}\n')
    journal.truncate()
    assert journal.path.read_text() == ""
    journal.close()


def test_the_journal_is_truncated_only_when_it_holds_something_and_no_batch_came_since(tmp_path, monkeypatch):
    """The sink hands a truncate to a thread once all is chained: an empty journal costs no system call,
    and a batch appended meanwhile (not chained yet) is never cut."""
    journal = Journal.open(tmp_path / "audit-journal")
    calls: list[int] = []
    real = audit_journal.os.ftruncate
    monkeypatch.setattr(audit_journal.os, "ftruncate", lambda fd, size: calls.append(size) or real(fd, size))
    journal.truncate()
    journal.append(['{"id": "a"}\n'])
    counted = journal.appends
    journal.append(['{"id": "b"}\n'])
    journal.truncate(counted)  # "b" came after the count: kept
    assert calls == [] and _journal_lines(journal.path) == [{"id": "a"}, {"id": "b"}]
    journal.truncate(journal.appends)
    journal.truncate()
    assert calls == [0] and journal.size() == 0 and journal.path.read_text() == ""
    journal.close()
    assert not journal.path.exists()


def test_an_append_can_empty_the_chained_journal_first(tmp_path):
    journal = Journal.open(tmp_path / "audit-journal")
    journal.append(['{"id": "a"}\n'])
    journal.append(['{"id": "b"}\n'], empty_first=True)
    assert _journal_lines(journal.path) == [{"id": "b"}] and journal.size() == len('{"id": "b"}\n')
    journal.close()
    assert journal.path.exists()  # "b" is not chained: the next start replays it


async def test_encrypted_records_keep_their_subject_as_a_keyed_hash_and_without_a_key_hashes(tmp_path):
    import hashlib
    import os

    from stages.audit import SEALED
    from store.audit import ContentVault
    from store.engine import make_engine
    from store.migrate import create_schema

    database = make_engine(f"sqlite:///{tmp_path / 'audit.db'}")
    create_schema(database)
    vault = ContentVault(database, os.urandom(32))
    record = {"pipeline": "chat", "status": "ok", "content_mode": "encrypted", "content_subject": "tags.user:alice",
              "input_content": "alice's question", "output_content": "an answer",
              "tags": json.dumps({"tier": "gold", "user": "alice"}),
              "stages": [{"stage_id": "lookup", "type": "tool", "status": "ok", "duration_ms": 1.0, "cost_usd": 0.0,
                          "step": {"tool": {"tool": "lookup", "outcome": "ok", SEALED: {
                              "arguments": {"who": "alice"}, "result": "alice lives here",
                              "arguments_sha256": "a" * 64, "result_sha256": "b" * 64}}}}]}
    for store in (AuditStore(database, spool_path=tmp_path / "a", vault=vault),
                  AuditStore(database, spool_path=tmp_path / "b")):  # no audit.master_key
        sink = StoreSink(store)
        await sink.write(json.loads(json.dumps(record)))
        await sink.aclose()
    reader = AuditStore(database, spool_path=tmp_path / "c")
    sealed, hashed = reader.query(AuditFilters(), sort="seq").records
    # A tool call's arguments and result: encrypted with the content, or, without a key, their hashes only.
    sealed_call, hashed_call = (reader.get(r["id"])["stages"][0]["step"]["tool"] for r in (sealed, hashed))
    assert set(sealed_call) == {"tool", "outcome", "content"}
    assert json.loads(vault.decrypt(sealed_call["content"])) == {"arguments": {"who": "alice"},
                                                                 "result": "alice lives here"}
    assert hashed_call == {"tool": "lookup", "outcome": "ok", "arguments_sha256": "a" * 64,
                           "result_sha256": "b" * 64}
    assert sealed["content_mode"] == "encrypted" and sealed["subject_hash"] == vault.subject_hash("tags.user:alice")
    assert vault.decrypt(sealed["tags"]) == record["tags"] and "alice" not in json.dumps(sealed)
    assert hashed["content_mode"] == "hash" and hashed["subject_hash"] is None
    assert hashed["tags"] == {name: hashlib.sha256(value.encode()).hexdigest()
                              for name, value in (("tier", "gold"), ("user", "alice"))}
    assert hashed["input_content"] == hashlib.sha256(b"alice's question").hexdigest()
