"""The tamper-evident audit log: one chained record per request, never lost.

    store = AuditStore(engine, spool_path=Path("var/audit.spool"), checkpoint_key=b"...")
    record_id = store.write({"pipeline": "support", "status": "ok", "stages": [...], ...})
    store.verify()                                    # VerifyReport(ok=True, checked=..., ...)
    store.query(AuditFilters(pipeline="support"), sort="-cost_usd", limit=50)
    store.prune({"support": 365})                     # deletes, then appends a chained prune marker

Each record is hashed into a chain (store/audit_chain.py). Appends lock the
one-row ``audit_chain_head`` table (``UPDATE ... RETURNING``: a row lock on
PostgreSQL, the write lock on SQLite), so seq and prev_hash stay consistent
across processes; a thread lock orders this process's writers before that.
On PostgreSQL a write is one round trip instead (store/audit_append.py): the
records are hashed onto the head this store last saw and ``audit_append()``
takes them only if, under that row lock, the head is still that one.
The server writes through :meth:`AuditStore.awrite_batch`, which does the
common case on the event loop without a thread hop (store/audit_append.py).
When the database is unreachable, records go to a local spool file
(store/audit_spool.py) and are replayed, exactly once, when it is back.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import psycopg
import sqlalchemy as sa

from store.audit_access import AccessFilters, access_page
from store.audit_append import AsyncOneTripAppender, OneTripAppender, SqliteLoopWriter
from store.audit_chain import checkpoint_row, json_line, normalize, record_hash, row_to_dict, sign_checkpoint
from store.audit_filters import AuditFilters
from store.audit_models import HEAD_ID, AuditAccess, AuditChainHead, AuditCheckpoint, AuditRecord, AuditStage
from store.audit_prune import PruneReport, prune_in
from store.audit_query import Page, export_lines, get_record, query_page, summarize
from store.audit_spool import Spool
from store.audit_verify import Finding, VerifyReport, verify_chain
from store.db import utcnow

__all__ = ["AccessFilters", "AuditFilters", "AuditStore", "AuditUnavailable", "Finding", "Page", "PruneReport",
           "VerifyReport"]

logger = logging.getLogger(__name__)

#: Errors that mean "the database is away", as opposed to a bad record: these go to the spool.
TRANSIENT_ERRORS = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError)
#: After a failed write, go straight to the spool this long before trying the database again,
#: so that an outage costs each request a file append, not a connect timeout.
RETRY_AFTER_S = 1.0
_CHUNK = 500  # rows per IN list and per replay transaction
_records = AuditRecord.__table__
_stages = AuditStage.__table__
_head = AuditChainHead.__table__
Item = tuple[dict[str, Any], list[dict[str, Any]]]
# Built once: constructing a statement costs more than SQLite takes to run it.
_LOCK_HEAD = (_head.update().where(_head.c.id == HEAD_ID).values(seq=_head.c.seq + sa.bindparam("count"))
              .returning(_head.c.seq, _head.c.hash))
_SET_HEAD_HASH = _head.update().where(_head.c.id == HEAD_ID).values(hash=sa.bindparam("head_hash"))
_INSERT_RECORDS = _records.insert()
_INSERT_STAGES = _stages.insert()


class AuditUnavailable(RuntimeError):
    """mode="required" and a record could be written neither to the database nor to the spool."""


class AuditStore:
    """Writes, verifies, queries and prunes the audit log. Thread-safe."""

    def __init__(self, engine: sa.Engine, *, spool_path: Path,
                 mode: Literal["best_effort", "required"] = "best_effort",
                 checkpoint_key: bytes | None = None, checkpoint_every: int = 1000) -> None:
        if mode not in ("best_effort", "required"):
            raise ValueError(f"unknown audit mode {mode!r}; use best_effort or required")
        if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError("checkpoint_every must be a positive integer")
        self.engine = engine
        self.mode = mode
        self._spool = Spool(spool_path)
        self._checkpoint_key = checkpoint_key
        self._checkpoint_every = checkpoint_every
        self._lock = threading.Lock()
        # PostgreSQL: one round trip per append (store/audit_append.py); SQLite: the locking append only.
        self._one_trip: OneTripAppender | None = None
        self._async_trip: AsyncOneTripAppender | None = None
        self._loop_writer = SqliteLoopWriter.for_engine(engine)
        if engine.dialect.name == "postgresql":
            self._one_trip = OneTripAppender(checkpoint_key=checkpoint_key, checkpoint_every=checkpoint_every)
            self._async_trip = AsyncOneTripAppender(engine, checkpoint_key=checkpoint_key,
                                                    checkpoint_every=checkpoint_every)
        self._db_retry_at = 0.0  # time.monotonic() before which the database counts as down

    # --- writing -------------------------------------------------------------------

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
        """:meth:`awrite_batch` for records already normalized (``store.audit_chain.normalize``).

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
                    if self.get(items[0][0]["id"]) is None:
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
        store/audit_journal.py), which is then removed; how many records were added."""
        with self._lock:
            added = self._replay_locked(Spool(path))
        path.unlink(missing_ok=True)
        return added

    def close(self) -> None:
        """Give back the connection that PostgreSQL writes hold between writes (engine.dispose() does too)."""
        with self._lock:
            if self._one_trip is not None:
                self._one_trip.close()
            if self._loop_writer is not None:
                self._loop_writer.close()

    def is_durable(self) -> bool:
        """Whether a write now would be kept: the database is up, or the spool can take it."""
        return time.monotonic() >= self._db_retry_at or self._spool.is_writable()

    def checkpoint(self) -> dict[str, Any] | None:
        """Sign the chain head now; None for an empty chain. Needs the checkpoint key."""
        if self._checkpoint_key is None:
            raise ValueError("no checkpoint key is configured")
        with self._lock, self.engine.begin() as conn:
            seq, head_hash = _lock_head(conn, 0)
            if seq == 0:
                return None
            if conn.scalar(sa.select(AuditCheckpoint.seq).where(AuditCheckpoint.seq == seq)) is None:
                self._insert_checkpoint(conn, seq, head_hash)
        return {"seq": seq, "head_hash": head_hash,
                "signature": sign_checkpoint(self._checkpoint_key, seq, head_hash)}

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
        if self._one_trip is not None:
            self._one_trip.forget_head()  # this append moves the head past what it remembers
        if skip_existing:
            # Idempotent replay: a crash after the insert but before the spool was truncated.
            ids = [row["id"] for row, _ in items]
            present = set(conn.scalars(sa.select(_records.c.id).where(_records.c.id.in_(ids))))
            items = [item for item in items if item[0]["id"] not in present]
        if not items:
            return 0
        last_seq, prev_hash = _lock_head(conn, len(items))
        rows, stage_rows = [], []
        for seq, (row, stages) in enumerate(items, start=last_seq - len(items) + 1):
            row = {**row, "seq": seq, "prev_hash": prev_hash, "legal_hold": False}
            row["hash"] = prev_hash = record_hash(prev_hash, row, stages)
            rows.append(row)
            stage_rows += [{**stage, "record_id": row["id"], "position": i} for i, stage in enumerate(stages)]
        conn.execute(_INSERT_RECORDS, rows)
        if stage_rows:
            conn.execute(_INSERT_STAGES, stage_rows)
        conn.execute(_SET_HEAD_HASH, {"head_hash": prev_hash})
        if self._checkpoint_key is not None:
            for row in rows:
                if row["seq"] % self._checkpoint_every == 0:
                    self._insert_checkpoint(conn, row["seq"], row["hash"])
        return len(rows)

    def _insert_checkpoint(self, conn: sa.Connection, seq: int, head_hash: str) -> None:
        conn.execute(sa.insert(AuditCheckpoint).values(
            checkpoint_row(self._checkpoint_key or b"", seq, head_hash, utcnow())))

    # --- checking and reading ---------------------------------------------------------

    def verify(self, since: datetime | None = None, until: datetime | None = None,
               checkpoint_key: bytes | None = None, workers: int | None = None) -> VerifyReport:
        """Check the chain (records received in [since, until), or all); checkpoints too with a key.

        Without *checkpoint_key*, the store's own key (if configured) checks the checkpoints.
        *workers*: processes hashing in parallel (None: one per CPU for long spans; 1: none).
        """
        return verify_chain(self.engine, since, until, checkpoint_key or self._checkpoint_key, workers)

    def query(self, filters: AuditFilters, *, sort: str = "-received_at", cursor: str | None = None,
              limit: int = 50) -> Page:
        """A page of matching records; ValueError for an unknown sort, a bad cursor or limit."""
        with self.engine.connect() as conn:
            return query_page(conn, filters, sort, cursor, limit)

    def get(self, record_id: str) -> dict[str, Any] | None:
        """One record with its key's ``key_name`` and its ``stages`` list; None if there is no such record."""
        if not isinstance(record_id, str):
            return None
        with self.engine.connect() as conn:
            return get_record(conn, record_id)

    def summary(self, filters: AuditFilters,
                group_by: Literal["pipeline", "model", "key_id", "day"]) -> list[dict[str, Any]]:
        """Per group: count, denied, block_rate, input/output tokens and cost_usd."""
        with self.engine.connect() as conn:
            return summarize(conn, filters, group_by)

    def export(self, filters: AuditFilters, fmt: Literal["jsonl", "csv"]) -> Iterator[str]:
        """Matching records (with stages) as JSON lines or CSV rows, streamed in seq order."""
        if fmt not in ("jsonl", "csv"):
            raise ValueError(f"unknown export format {fmt!r}; use jsonl or csv")
        return export_lines(self.engine, filters, fmt)

    def log_access(self, key_id: str | None, role: str | None, action: str, query: Mapping[str, Any]) -> None:
        """Record that *key_id* read the audit log (*action*, with the *query* it asked)."""
        safe_query = {str(k): v if isinstance(v, str | int | float | bool | type(None)) else str(v)
                      for k, v in query.items()}
        with self.engine.begin() as conn:
            conn.execute(sa.insert(AuditAccess).values(at=utcnow(), key_id=key_id, role=role, action=action,
                                                       query=safe_query))

    def access(self, filters: AccessFilters, *, cursor: str | None = None, limit: int = 50) -> Page:
        """A page of the access log matching *filters*, newest first; ValueError for a bad cursor or limit."""
        with self.engine.connect() as conn:
            return access_page(conn, filters, cursor, limit)

    def access_log(self, limit: int = 100) -> list[dict[str, Any]]:
        """The latest accesses, newest first."""
        statement = sa.select(AuditAccess.__table__).order_by(AuditAccess.id.desc()).limit(max(1, min(limit, 10_000)))
        with self.engine.connect() as conn:
            return [row_to_dict(dict(row)) for row in conn.execute(statement).mappings()]

    # --- retention --------------------------------------------------------------------

    def set_hold(self, *, pipeline: str | None = None, record_ids: list[str] | None = None, on: bool = True) -> int:
        """Put (or lift) a legal hold on a pipeline's records and/or on given records; how many rows."""
        if pipeline is None and not record_ids:
            raise ValueError("set_hold needs a pipeline or record_ids")
        changed = 0
        with self.engine.begin() as conn:
            if pipeline is not None:
                changed += conn.execute(_records.update().where(_records.c.pipeline == pipeline,
                                                                _records.c.kind == "record")
                                        .values(legal_hold=bool(on))).rowcount
            ids = list(record_ids or [])
            for start in range(0, len(ids), _CHUNK):
                where = [_records.c.id.in_(ids[start:start + _CHUNK]), _records.c.kind == "record"]
                if pipeline is not None:  # those were counted above
                    where.append(_records.c.pipeline != pipeline)
                changed += conn.execute(_records.update().where(*where).values(legal_hold=bool(on))).rowcount
        return changed

    def prune(self, retention_days: Mapping[str, int], now: datetime | None = None) -> PruneReport:
        """Delete records older than their pipeline's retention and not on hold; chain a marker for them.

        Pipelines missing from *retention_days* are kept. The marker lists each
        deleted seq range with the hashes that link over it, so verify still passes.
        """
        now = now or utcnow()
        with self._lock, self.engine.begin() as conn:
            _lock_head(conn, 0)  # first: on SQLite this takes the write lock before anything is read
            return prune_in(conn, retention_days, now,
                            lambda item: self._append([item], skip_existing=False, conn=conn))


def _lock_head(conn: sa.Connection, count: int) -> tuple[int, str]:
    """Lock the chain head and advance it by *count*: (the new last seq, the hash before this append)."""
    return tuple(conn.execute(_LOCK_HEAD, {"count": count}).one())  # type: ignore[return-value]

