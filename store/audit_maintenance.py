"""Upkeep of the audit log: legal holds, and pruning past each pipeline's retention.

    maintenance = AuditMaintenance(engine, checkpoint_key=b"...")
    maintenance.set_hold(pipeline="support")          # how many records are now held
    maintenance.prune({"support": 365})               # deletes, then appends a chained prune marker

A hold is a column outside the hash (store/audit_chain.py), so setting one
changes no record's hash. A prune deletes records past retention and not on
hold, then chains a marker that accounts for them (store/audit_prune.py)
through the locking append (store/audit_locking_append.py): alone, its own,
with the key that signs a checkpoint should the marker land on one; in the
server's store, the writer's (:meth:`AuditMaintenance.for_writer`), so that a
prune and this process's writes take one lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

import sqlalchemy as sa

from store.audit_locking_append import LockingAppender, lock_head
from store.audit_models import AuditRecord
from store.audit_prune import PruneReport, prune_in
from store.audit_signing import Signer
from store.audit_writer import AuditWriter
from store.db import utcnow

__all__ = ["AuditMaintenance", "PruneReport"]

_CHUNK = 500  # ids per IN list
_records = AuditRecord.__table__


class AuditMaintenance:
    """Puts records on legal hold (or lifts it) and prunes expired ones. Thread-safe."""

    def __init__(self, engine: sa.Engine, *, checkpoint_key: bytes | Signer | None = None,
                 checkpoint_every: int = 1000) -> None:
        self.engine = engine
        self._chain = LockingAppender(checkpoint_key=checkpoint_key, checkpoint_every=checkpoint_every)

    @classmethod
    def for_writer(cls, writer: AuditWriter) -> AuditMaintenance:
        """Maintenance over *writer*'s engine that chains prune markers through *writer*'s locking append:
        its lock, its checkpoint key, and its PostgreSQL appender told that the head moved."""
        maintenance = cls(writer.engine)
        maintenance._chain = writer.chain
        return maintenance

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
        with self._chain.lock, self.engine.begin() as conn:
            lock_head(conn, 0)  # first: on SQLite this takes the write lock before anything is read
            return prune_in(conn, retention_days, now, lambda item: self._chain.append(conn, [item]))
