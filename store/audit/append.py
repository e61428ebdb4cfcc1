"""Chaining records on PostgreSQL in one round trip, through ``audit_append()`` (revision 0004).

    appender = OneTripAppender(checkpoint_key=key, checkpoint_every=1000)
    if not appender.append(engine, items):   # False: nothing written; use the locking append
        ...
    appender.close()                         # or engine.dispose()

The locking append (store/audit/locking_append.py) takes the chain head's row lock, reads the
head, hashes the records onto it and inserts them: six round trips and a
commit per request. Here the writer remembers the head it last saw, hashes onto
that, and sends the records (as the canonical JSON their hashes cover), their
stages and any checkpoints in one autocommit call. The function advances the
head only if it is still the remembered one (a compare-and-set under the
head's row lock), so writers in several processes still form one chain. When
another writer has moved the head, nothing is written and the call returns
the head as it is: the records are hashed onto that and sent once more, and a
second miss hands them back to the locking append, which cannot miss.

The writer keeps one connection of the engine's pool checked out: the store's
lock serializes writes anyway, and it saves the pool's pre-ping round trip per
write. A connection that turns out dead is replaced and the call sent again,
once; that is safe because a call whose commit did happen but whose answer
was lost misses the compare-and-set, and its records then collide with
themselves on their ids. The connection is closed by :meth:`close` or when
the engine is disposed.

The server's writes come from the event loop (AuditWriter.awrite_batch), where
a thread hop costs as much as the write: :class:`AsyncOneTripAppender` sends
the same call on an async psycopg connection, and :class:`SqliteLoopWriter`
runs a SQLite file's locking append on the loop when it needs no waiting.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import sqlalchemy as sa

from store.audit.chain import checkpoint_row, hashed_canonical, utc_text
from store.audit.models import HEAD_ID
from store.audit.signing import Signer
from store.db import utcnow

#: (row values, stage rows) of one normalized record (store/audit/chain.normalize).
Item = tuple[dict[str, Any], list[dict[str, Any]]]
_CALL = ("SELECT appended, head_seq, head_hash FROM audit_append(%(seq)s, %(hash)s, %(new_seq)s, %(new_hash)s, "
         "CAST(%(records)s AS json), CAST(%(stages)s AS json), CAST(%(checkpoints)s AS json))")
_READ = ("SELECT h.seq, h.hash, to_regprocedure('audit_append(bigint, text, bigint, text, json, json, json)') "
         f"IS NOT NULL FROM audit_chain_head AS h WHERE h.id = {HEAD_ID}")
# Stage rows hold typed values already (normalize): any compact encoding will do.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_CALLS_PER_APPEND = 2
logger = logging.getLogger(__name__)
#: The async appender's connect: past this, the write takes the blocking path (and its spool).
CONNECT_TIMEOUT_S = 2


class _HeadGuess:
    """What both appenders keep: the chain head as last seen (only ever a guess; the compare-and-set
    keeps a wrong one safe), whether the database has audit_append(), and the call's arguments."""

    def __init__(self, *, checkpoint_key: bytes | Signer | None, checkpoint_every: int) -> None:
        self._checkpoint_key = checkpoint_key
        self._checkpoint_every = checkpoint_every
        self._head: tuple[int, str] | None = None  # (seq, hash)
        self._available: bool | None = None

    def forget_head(self) -> None:
        """The head moved by another path (the locking append): read it again next time."""
        self._head = None

    def _saw_head(self, row: Any) -> bool:
        """Take ``_READ``'s answer; whether audit_append() can be called."""
        seq, head_hash, self._available = row
        self._head = (seq, head_hash) if self._available else None
        return bool(self._available)

    def _took(self, row: Any) -> bool:
        """Take ``_CALL``'s answer: whether the records went in (if not, the head moved and is now known)."""
        appended, head_seq, head_hash = row
        self._head = (head_seq, head_hash)
        return bool(appended)

    def _params(self, items: list[Item]) -> dict[str, Any]:
        """audit_append()'s arguments: records (their canonical JSON plus ``hash``), stages, checkpoints."""
        head_seq, head_hash = self._head  # type: ignore[misc]
        records, stage_rows, checkpoints = [], [], []
        seq, prev_hash = head_seq, head_hash
        for row, stages in items:
            seq += 1
            prev_hash, text = hashed_canonical(prev_hash, {**row, "seq": seq, "prev_hash": prev_hash}, stages)
            records.append(f'{{"hash":"{prev_hash}",{text[1:]}')  # the canonical object, with its hash added
            stage_rows += [{**stage, "record_id": row["id"], "position": n} for n, stage in enumerate(stages)]
            if self._checkpoint_key is not None and seq % self._checkpoint_every == 0:
                checkpoints.append(_json_checkpoint(checkpoint_row(self._checkpoint_key, seq, prev_hash, utcnow())))
        return {"seq": head_seq, "hash": head_hash, "new_seq": seq, "new_hash": prev_hash,
                "records": "[" + ",".join(records) + "]",
                "stages": _ENCODER.encode(stage_rows) if stage_rows else None,
                "checkpoints": "[" + ",".join(checkpoints) + "]" if checkpoints else None}


class OneTripAppender(_HeadGuess):
    """Appends to the chain with one ``audit_append()`` call. Not thread-safe: the store's lock orders callers."""

    def __init__(self, *, checkpoint_key: bytes | Signer | None, checkpoint_every: int) -> None:
        super().__init__(checkpoint_key=checkpoint_key, checkpoint_every=checkpoint_every)
        self._conn: sa.Connection | None = None

    def append(self, engine: sa.Engine, items: list[Item]) -> bool:
        """Chain *items* (at least one) in one transaction; False, having written nothing, when it could not.

        Database errors propagate as they would from the locking append: an
        IntegrityError for an id already in the log, OperationalError while
        the database is away.
        """
        if self._available is False:
            return False
        held = self._conn is not None and self._conn.engine is engine
        try:
            appended = self._append(self._connection(engine), items)
            if self._available is False:
                self.close()  # a database without revision 0004: the locking append it is, from now on
            return appended
        except sa.exc.DBAPIError as exc:
            if not (held and exc.connection_invalidated):
                raise
            self.close()  # it went stale (server restart, idle timeout): once more on a fresh one
        except BaseException:
            self.close()  # interrupted mid-call: what the connection holds is unknown
            raise
        return self._append(self._connection(engine), items)

    def close(self) -> None:
        """Give the writer's connection back (closed: it may outlive the pool it came from)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.invalidate()
            conn.close()

    def _connection(self, engine: sa.Engine) -> sa.Connection:
        if self._conn is not None and self._conn.engine is not engine:
            self.close()
        if self._conn is None:
            conn = engine.connect()
            # Autocommit: the call is its own transaction, so BEGIN and COMMIT cost no round trips.
            conn.execution_options(isolation_level="AUTOCOMMIT")
            if not sa.event.contains(engine, "engine_disposed", self._on_dispose):
                sa.event.listen(engine, "engine_disposed", self._on_dispose)
            self._conn = conn
        return self._conn

    def _on_dispose(self, engine: sa.Engine) -> None:
        if self._conn is not None and self._conn.engine is engine:
            self.close()

    def _append(self, conn: sa.Connection, items: list[Item]) -> bool:
        try:
            if self._head is None and not self._saw_head(conn.exec_driver_sql(_READ).one()):
                return False
            for _ in range(_CALLS_PER_APPEND):
                if self._took(conn.exec_driver_sql(_CALL, self._params(items)).one()):
                    return True
            return False
        except BaseException:
            self._head = None  # the call may have committed before its answer was lost
            raise


class AsyncOneTripAppender(_HeadGuess):
    """:class:`OneTripAppender` on the event loop: psycopg's async connection, no thread hop.

    What the server's audit sink uses on PostgreSQL, where the thread hop of a
    blocking write costs as much as the database's own work. It keeps its own
    guess of the head (the compare-and-set keeps that safe next to the
    blocking writers of this and other processes) and its own autocommit
    connection, opened from the engine's URL on first use, on the loop that
    uses it. Callers must not overlap calls (the sink writes one batch at a time).
    """

    def __init__(self, engine: sa.Engine, *, checkpoint_key: bytes | Signer | None, checkpoint_every: int) -> None:
        super().__init__(checkpoint_key=checkpoint_key, checkpoint_every=checkpoint_every)
        self._conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def append(self, items: list[Item]) -> bool:
        """Chain *items* in one call; False, having written nothing, when the head moved twice or the
        database has no audit_append(). Errors propagate (the connection is dropped first): the caller
        falls back to the blocking path, which sorts out an outage or a record that did get in."""
        if self._available is False:
            return False
        try:
            conn = await self._connection()
            if self._head is None and not self._saw_head(await (await conn.execute(_READ)).fetchone()):
                await self.aclose()
                return False
            for _ in range(_CALLS_PER_APPEND):
                if self._took(await (await conn.execute(_CALL, self._params(items))).fetchone()):
                    return True
            return False
        except BaseException:
            await self.aclose()  # what the connection holds, and whether the call committed, is unknown
            raise

    async def aclose(self) -> None:
        conn, self._conn, self._head = self._conn, None, None
        if conn is not None and not conn.closed:
            if self._loop is asyncio.get_running_loop():
                await conn.close()
            else:  # opened on a loop that is gone: only its socket is left to close
                conn.pgconn.finish()

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        loop = asyncio.get_running_loop()
        if self._conn is not None and (self._loop is not loop or self._conn.closed):
            await self.aclose()
        if self._conn is None:
            self._conn = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True,
                                                               connect_timeout=CONNECT_TIMEOUT_S)
            self._loop = loop
        return self._conn


class SqliteLoopWriter:
    """SQLite writes on the event loop, only when they cannot wait.

    A write to a SQLite file in WAL mode with ``synchronous=NORMAL`` is a few
    hundred microseconds of CPU, most of it holding the GIL either way, so a
    thread hop only adds its own cost. What could stall the loop is waiting:
    for another writer's lock or for a WAL checkpoint. This writer's own
    connection has ``busy_timeout=0`` (a held lock fails the write at once,
    and the caller takes the blocking path) and ``wal_autocheckpoint=0``; it
    leaves the checkpoint to a thread every ``CHECKPOINT_EVERY`` writes.
    Not for in-memory databases (their one connection is shared). Not
    thread-safe: the store's lock orders callers.
    """

    CHECKPOINT_EVERY = 500

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._conn: sa.Connection | None = None
        self._writes = 0
        self._checkpointing: threading.Thread | None = None

    @classmethod
    def for_engine(cls, engine: sa.Engine) -> SqliteLoopWriter | None:
        if engine.dialect.name != "sqlite" or isinstance(engine.pool, sa.pool.StaticPool):
            return None
        return cls(engine)

    def write(self, append: Callable[[sa.Connection], object]) -> bool:
        """Run *append* in one transaction on this writer's connection; False, with nothing written,
        when the database is locked or anything fails (the blocking path then tries, and explains)."""
        try:
            conn = self._connection()
            with conn.begin():
                append(conn)
        except sa.exc.DBAPIError:
            self.close()  # a busy database, or worse: the next write starts on a fresh connection
            return False
        self._writes += 1
        if self._writes % self.CHECKPOINT_EVERY == 0 and not (self._checkpointing and self._checkpointing.is_alive()):
            self._checkpointing = threading.Thread(target=self._checkpoint, name="audit-wal-checkpoint", daemon=True)
            self._checkpointing.start()
        return True

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.invalidate()  # never back to the pool: its pragmas are this writer's alone
            conn.close()

    def _connection(self) -> sa.Connection:
        if self._conn is None:
            conn = self._engine.connect()
            conn.exec_driver_sql("PRAGMA busy_timeout=0")
            conn.exec_driver_sql("PRAGMA wal_autocheckpoint=0")
            conn.commit()
            self._conn = conn
        return self._conn

    def _checkpoint(self) -> None:
        try:
            with self._engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
        except sa.exc.DBAPIError as exc:  # the next one tries again; other connections checkpoint too
            logger.warning("audit: WAL checkpoint failed: %s", exc)


def _json_checkpoint(row: dict[str, Any]) -> str:
    return json.dumps({**row, "created_at": utc_text(row["created_at"])})
