"""Writing the audit log: chaining records, never losing one, and signing checkpoints as the chain grows.

    writer = AuditWriter(engine, spool_path=Path("var/audit.spool"), checkpoint_key=b"...")
    record_id = writer.write({"pipeline": "support", "status": "ok", "stages": [...], ...})
    await writer.awrite_batch(records)                # the server's group commit, from the event loop
    writer.replay_file(Path("audit-journal.123-ab.jsonl"))  # a stopped process's journal
    writer.checkpoint()                               # sign the head now
    writer.cover_head()                               # the same, unless a checkpoint is there already

Each record is hashed into a chain (store/audit/chain.py) by the locking
append (store/audit/locking_append.py), which takes the chain head's row lock;
a thread lock orders this process's writers before that. On PostgreSQL a
write is one round trip instead (store/audit/append.py): the records are
hashed onto the head this writer last saw and ``audit_append()`` takes them
only if, under that row lock, the head is still that one. The server writes
through :meth:`AuditWriter.awrite_batch`, which does the common case on the
event loop without a thread hop. When the database is unreachable, records go
to a local spool file (store/audit/spool.py) and are replayed, exactly once,
when it is back; journals of stopped processes (store/audit/journal.py) are
replayed the same way. Checkpoints come at multiples of ``checkpoint_every``
from a writer with the key and, from a serving process that holds it, at the
head every few seconds (:meth:`AuditWriter.cover_head`), whoever appended the
records since. Reading the log is store/audit/reader.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import psycopg
import sqlalchemy as sa

from store.audit.append import AsyncOneTripAppender, Item, OneTripAppender, SqliteLoopWriter
from store.audit.chain import json_line, normalize, sign_checkpoint
from store.audit.locking_append import LockingAppender, lock_head
from store.audit.models import HEAD_ID, AuditChainHead, AuditCheckpoint, AuditRecord
from store.audit.signing import Signer
from store.audit.spool import Spool
from store.db import utcnow

__all__ = ["AuditUnavailable", "AuditWriter", "Item"]

logger = logging.getLogger(__name__)

#: Errors that mean "the database is away", as opposed to a bad record: these go to the spool.
TRANSIENT_ERRORS = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError)
#: After a failed write, go straight to the spool this long before trying the database again,
#: so that an outage costs each request a file append, not a connect timeout.
RETRY_AFTER_S = 1.0
_CHUNK = 500  # rows per IN list and per replay transaction
_records = AuditRecord.__table__
_head = AuditChainHead.__table__
_checkpoints = AuditCheckpoint.__table__
#: The head's seq, and whether a checkpoint signs it.
_HEAD_COVERED = (sa.select(_head.c.seq, sa.exists().where(_checkpoints.c.seq == _head.c.seq))
                 .where(_head.c.id == HEAD_ID))


class AuditUnavailable(RuntimeError):
    """mode="required" and a record could be written neither to the database nor to the spool."""


class AuditWriter:
    """Chains records into the audit log, spooling them while the database is away. Thread-safe."""

    def __init__(self, engine: sa.Engine, *, spool_path: Path,
                 mode: Literal["best_effort", "required"] = "best_effort",
                 checkpoint_key: bytes | Signer | None = None, checkpoint_every: int = 1000) -> None:
        if mode not in ("best_effort", "required"):
            raise ValueError(f"unknown audit mode {mode!r}; use best_effort or required")
        #: The locking append, with this writer's lock and checkpoint key; maintenance shares it.
        self.chain = LockingAppender(checkpoint_key=checkpoint_key, checkpoint_every=checkpoint_every)
        self.engine = engine
        self.mode = mode
        self._spool = Spool(spool_path)
        self._lock = self.chain.lock
        # PostgreSQL: one round trip per append (store/audit/append.py); SQLite: the locking append only.
        self._one_trip: OneTripAppender | None = None
        self._async_trip: AsyncOneTripAppender | None = None
        self._loop_writer = SqliteLoopWriter.for_engine(engine)
        if engine.dialect.name == "postgresql":
            self._one_trip = OneTripAppender(checkpoint_key=checkpoint_key, checkpoint_every=checkpoint_every)
            self._async_trip = AsyncOneTripAppender(engine, checkpoint_key=checkpoint_key,
                                                    checkpoint_every=checkpoint_every)
            self.chain.head_guess = self._one_trip
        self._db_retry_at = 0.0  # time.monotonic() before which the database counts as down

    def write(self, record: Mapping[str, Any]) -> str:
        """Chain *record* into the log (or spool it while the database is away); its id.

        Raises ValueError for a malformed record, and AuditUnavailable (mode
        "required") when neither the database nor the spool takes it.
        """
        return self.write_batch([record])[0]

    def write_batch(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """:meth:`write` for several records in one transaction (the server's group commit)."""
        items = [normalize(record, utcnow()) for record in records]
        self._write_items(items)
        return [row["id"] for row, _ in items]

    async def awrite_batch(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """:meth:`write_batch` for the event loop.

        The common case (database up, spool empty) skips the thread hop, which
        costs as much as the write itself: on PostgreSQL it is one
        ``audit_append()`` call on the loop's own async connection; on a SQLite
        file, a write that can take the database's lock at once, on the loop
        (:class:`SqliteLoopWriter`). Anything else (an outage, a spool to
        replay first, a lock held elsewhere, an error, a head that moved twice)
        goes to :meth:`write_batch`'s blocking path in a thread, which sorts it out.
        """
        items = [normalize(record, utcnow()) for record in records]
        await self.awrite_items(items)
        return [row["id"] for row, _ in items]

    async def awrite_items(self, items: list[Item], *, strict: bool = False) -> None:
        """:meth:`awrite_batch` for records already normalized (``store.audit.chain.normalize``).

        *strict*: raise AuditUnavailable when neither the database nor the spool takes them, whatever
        the mode (best_effort would log them as lost): for a caller that still holds them elsewhere
        (the server's journal) and will try again."""
        if time.monotonic() >= self._db_retry_at and self._spool.is_empty():
            if self._async_trip is not None:
                try:
                    if await self._async_trip.append(items):
                        return
                except (psycopg.Error, OSError) as exc:
                    # Retried below; if the call did commit, its records now collide with themselves by id.
                    logger.debug("audit: async append failed (%s); taking the blocking path", type(exc).__name__)
            elif self._loop_writer is not None and self._lock.acquire(blocking=False):
                try:
                    written = self._loop_writer.write(lambda conn: self._append(items, skip_existing=False,
                                                                                conn=conn))
                finally:
                    self._lock.release()
                if written:
                    return
        await asyncio.to_thread(self._write_items, items, strict)

    def write_many(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """Chain *records* in order, 2,000 per transaction (bulk loads); no spool: errors propagate."""
        items = [normalize(record, utcnow()) for record in records]
        with self._lock:
            for start in range(0, len(items), _CHUNK * 4):
                self._append(items[start:start + _CHUNK * 4], skip_existing=False)
        return [row["id"] for row, _ in items]

    def replay_spool(self) -> int:
        """Chain the spooled records, in order, skipping ids already in the log; how many were added."""
        with self._lock:
            return self._replay_locked(self._spool)

    def replay_file(self, path: Path) -> int:
        """:meth:`replay_spool` for another file of spool lines (a dead process's journal,
        store/audit/journal.py), which is then removed; how many records were added."""
        with self._lock:
            added = self._replay_locked(Spool(path))
        path.unlink(missing_ok=True)
        return added

    def is_durable(self) -> bool:
        """Whether a write now would be kept: the database is up, or the spool can take it."""
        return time.monotonic() >= self._db_retry_at or self._spool.is_writable()

    def checkpoint(self) -> dict[str, Any] | None:
        """Sign the chain head now; None for an empty chain. Needs the checkpoint key."""
        key = self.chain.checkpoint_key
        if key is None:
            raise ValueError("no checkpoint key is configured")
        with self._lock, self.engine.begin() as conn:
            seq, head_hash = lock_head(conn, 0)
            if seq == 0:
                return None
            if conn.scalar(sa.select(AuditCheckpoint.seq).where(AuditCheckpoint.seq == seq)) is None:
                self.chain.insert_checkpoint(conn, seq, head_hash)
        return {"seq": seq, "head_hash": head_hash, "signature": sign_checkpoint(key, seq, head_hash)}

    def cover_head(self) -> int | None:
        """Sign a checkpoint at the chain head unless one is there already, whichever process appended the
        records since the last (one without the key too); the seq signed, or None. Nothing is locked or
        written while the head has its checkpoint. Writers sharing a database, each calling this, leave
        one checkpoint per head: the head's lock orders them. Needs the checkpoint key."""
        if self.chain.checkpoint_key is None:
            raise ValueError("no checkpoint key is configured")
        with self.engine.connect() as conn:
            seq, covered = conn.execute(_HEAD_COVERED).one()
        if seq == 0 or covered:
            return None
        with self._lock, self.engine.begin() as conn:
            seq, head_hash = lock_head(conn, 0)
            if seq == 0 or conn.scalar(sa.select(AuditCheckpoint.seq).where(AuditCheckpoint.seq == seq)) is not None:
                return None
            self.chain.insert_checkpoint(conn, seq, head_hash)
        return seq

    def close(self) -> None:
        """Give back the connection that PostgreSQL writes hold between writes (engine.dispose() does too)."""
        with self._lock:
            if self._one_trip is not None:
                self._one_trip.close()
            if self._loop_writer is not None:
                self._loop_writer.close()

    async def aclose(self) -> None:
        """:meth:`close`, and the event loop's connections too."""
        if self._async_trip is not None:
            await self._async_trip.aclose()
        await asyncio.to_thread(self.close)

    def _write_items(self, items: list[Item], strict: bool = False) -> None:
        with self._lock:
            if time.monotonic() >= self._db_retry_at:
                try:
                    if not self._spool.is_empty():
                        self._replay_before_write()
                    self._append(items, skip_existing=False)
                    return
                except sa.exc.IntegrityError:
                    if len(items) > 1:  # find the duplicate one by one
                        for item in items:
                            self._write_one_locked(item, strict)
                        return
                    if not self._is_chained(items[0][0]["id"]):
                        raise
                    return  # the same record written twice: once is enough
                except TRANSIENT_ERRORS as exc:
                    self._db_retry_at = time.monotonic() + RETRY_AFTER_S
                    logger.warning("audit database unavailable, spooling to %s: %s", self._spool.path,
                                   type(exc).__name__)
            for item in items:
                self._spool_item(item, strict)

    def _write_one_locked(self, item: Item, strict: bool = False) -> None:
        try:
            self._append([item], skip_existing=True)
        except TRANSIENT_ERRORS:
            self._spool_item(item, strict)

    def _is_chained(self, record_id: str) -> bool:
        with self.engine.connect() as conn:
            return conn.scalar(sa.select(_records.c.id).where(_records.c.id == record_id)) is not None

    def _replay_before_write(self) -> None:
        # Spooled records first: they happened first. A spool that cannot be read must not
        # cost the record in hand as well; it stays for replay_spool() and an operator.
        try:
            self._replay_locked(self._spool)
        except OSError as exc:
            logger.error("audit spool %s could not be replayed: %s", self._spool.path, exc)

    def _spool_item(self, item: Item, strict: bool = False) -> None:
        try:
            self._spool.append(json_line(*item))
        except OSError as exc:
            if self.mode == "required" or strict:
                raise AuditUnavailable(f"audit database and spool {self._spool.path} both unavailable") from exc
            logger.error("audit record %s LOST: database and spool %s both unavailable: %s",
                         item[0]["id"], self._spool.path, exc)

    def _replay_locked(self, spool: Spool) -> int:
        added = 0
        with spool.claimed() as records:
            items = []
            for record in records:
                try:
                    items.append(normalize(record, utcnow()))
                except ValueError as exc:
                    spool.reject(record, str(exc))
            for start in range(0, len(items), _CHUNK):
                added += self._append(items[start:start + _CHUNK], skip_existing=True)
        if added:
            logger.info("audit: replayed %d record(s) from %s", added, spool.path)
        return added

    def _append(self, items: list[Item], *, skip_existing: bool, conn: sa.Connection | None = None) -> int:
        if conn is None:
            if not skip_existing and self._one_trip is not None and self._one_trip.append(self.engine, items):
                return len(items)
            with self.engine.begin() as own:
                return self._append(items, skip_existing=skip_existing, conn=own)
        if skip_existing:
            # Idempotent replay: a crash after the insert but before the spool was truncated.
            ids = [row["id"] for row, _ in items]
            present = set(conn.scalars(sa.select(_records.c.id).where(_records.c.id.in_(ids))))
            items = [item for item in items if item[0]["id"] not in present]
        return self.chain.append(conn, items)
