"""Upkeep of the audit log: legal holds, and pruning past each pipeline's retention.

    maintenance = AuditMaintenance(engine, checkpoint_key=b"...")
    maintenance.set_hold(pipeline="support")          # how many records are now held
    maintenance.prune({"support": 365})               # deletes, then appends a chained prune marker

A hold is a column outside the hash (store/audit/chain.py), so setting one
changes no record's hash. A prune deletes records past retention and not on
hold, then chains a marker that accounts for them (store/audit/prune.py)
through the locking append (store/audit/locking_append.py): alone, its own,
with the key that signs a checkpoint should the marker land on one; in the
server's store, the writer's (:meth:`AuditMaintenance.for_writer`), so that a
prune and this process's writes take one lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from store.audit.chain import normalize
from store.audit.filters import SubjectMatch
from store.audit.locking_append import LockingAppender, lock_head
from store.audit.models import AuditRecord
from store.audit.prune import PruneReport, prune_in
from store.audit.query import of_subject
from store.audit.signing import Signer
from store.audit.vault import ContentVault
from store.audit.writer import AuditWriter
from store.db import utcnow

__all__ = ["AuditMaintenance", "ErasureReport", "PruneReport"]


@dataclass(frozen=True, slots=True)
class ErasureReport:
    #: The subject's keyed hash (ContentVault.subject_hash), as the erasure record names it.
    subject_id: str
    records: int
    keys_destroyed: int
    #: The chained erasure record.
    record_id: str

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

    def erase(self, vault: ContentVault, subject: str, by: str, now: datetime | None = None) -> ErasureReport:
        """Crypto-shred *subject*: destroy its data keys, so that the content and tags of its encrypted records
        can no longer be read, and chain an erasure record (who, when, the subject's keyed hash, how many
        records; its records are found by that hash, or, chained before records kept it, by key). The
        records and their hashes stay: the chain still verifies. ValueError when the subject has no
        encrypted content, or when any of its records is on legal hold (then nothing is erased)."""
        now = now or utcnow()
        key_ids = vault.key_ids(subject)
        if not key_ids:
            raise ValueError("no encrypted audit content names this subject (check its form: key:ID, "
                             "tenant:NAME or tags.FIELD:VALUE)")
        c, sid = _records.c, vault.subject_hash(subject)
        subject_records = of_subject(SubjectMatch(sid, tuple(key_ids)))
        with self._chain.lock, self.engine.begin() as conn:
            lock_head(conn, 0)
            count = conn.scalar(sa.select(sa.func.count()).select_from(_records).where(subject_records)) or 0
            held = conn.scalar(sa.select(sa.func.count()).select_from(_records).where(
                subject_records, c.legal_hold.is_(True))) or 0
            if held:
                raise ValueError(f"{held} of this subject's {count} record(s) are on legal hold: release the hold "
                                 "first (inferline audit hold --release); nothing was erased")
            destroyed = vault.erase(subject, by, conn)
            message = (f"erase subject {sid[:16]}: the content of {count} record(s) made unreadable "
                       f"({len(destroyed)} data key(s) destroyed) by {by}")
            row, stages = normalize({
                "pipeline": "", "status": "ok", "completed_at": now, "received_at": now, "content_mode": "hash",
                "key_id": by[:64], "policy": [{"stage": "server", "where": "erase", "rule": "erase",
                                               "category": "erasure", "action": "allow", "score": 1.0, "span": [],
                                               "message": message, "subject_id": sid}],
                "policy_action": "allow", "policy_categories": "erasure"}, now)
            self._chain.append(conn, [(row, stages)])
        return ErasureReport(sid, count, len(destroyed), row["id"])

    def prune(self, retention_days: Mapping[str, int], now: datetime | None = None) -> PruneReport:
        """Delete records older than their pipeline's retention and not on hold; chain a marker for them.

        Pipelines missing from *retention_days* are kept. The marker lists each
        deleted seq range with the hashes that link over it, so verify still passes.
        """
        now = now or utcnow()
        with self._chain.lock, self.engine.begin() as conn:
            lock_head(conn, 0)  # first: on SQLite this takes the write lock before anything is read
            return prune_in(conn, retention_days, now, lambda item: self._chain.append(conn, [item]))
