"""The locking append: records chained in the caller's transaction, under the chain head's row lock.

    chain = LockingAppender(checkpoint_key=key, checkpoint_every=1000)
    with chain.lock, engine.begin() as conn:
        chain.append(conn, items)           # all of them: this append cannot miss

Locking the one-row ``audit_chain_head`` table (``UPDATE ... RETURNING``: a row
lock on PostgreSQL, the write lock on SQLite) keeps seq and prev_hash
consistent across processes; :attr:`LockingAppender.lock`, a thread lock,
orders this process's appenders before that. The writer
(store/audit/writer.py) and maintenance (store/audit/maintenance.py, whose
prune chains a marker) of one store share one LockingAppender, hence one lock.
PostgreSQL's one-round-trip append (store/audit/append.py) remembers the head
it last saw; an append here moves the head, so it is told to read it again.
"""

from __future__ import annotations

import threading

import sqlalchemy as sa

from store.audit.append import Item, OneTripAppender
from store.audit.chain import checkpoint_row, record_hash
from store.audit.models import HEAD_ID, AuditChainHead, AuditCheckpoint, AuditRecord, AuditStage
from store.audit.signing import Signer
from store.db import utcnow

_records = AuditRecord.__table__
_stages = AuditStage.__table__
_head = AuditChainHead.__table__
# Built once: constructing a statement costs more than SQLite takes to run it.
_LOCK_HEAD = (_head.update().where(_head.c.id == HEAD_ID).values(seq=_head.c.seq + sa.bindparam("count"))
              .returning(_head.c.seq, _head.c.hash))
_SET_HEAD_HASH = _head.update().where(_head.c.id == HEAD_ID).values(hash=sa.bindparam("head_hash"))
_INSERT_RECORDS = _records.insert()
_INSERT_STAGES = _stages.insert()


class LockingAppender:
    """Chains records onto the head it locks, signing a checkpoint every *checkpoint_every* seqs with a key.

    Not thread-safe by itself: callers hold :attr:`lock` around each transaction that appends.
    """

    def __init__(self, *, checkpoint_key: bytes | Signer | None = None, checkpoint_every: int = 1000) -> None:
        if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError("checkpoint_every must be a positive integer")
        self.checkpoint_key = checkpoint_key
        self.checkpoint_every = checkpoint_every
        self.lock = threading.Lock()
        #: This process's one-round-trip appender, if any: told when an append here moves the head.
        self.head_guess: OneTripAppender | None = None

    def append(self, conn: sa.Connection, items: list[Item]) -> int:
        """Chain *items* in order in *conn*'s transaction; how many (all of them)."""
        if self.head_guess is not None:
            self.head_guess.forget_head()
        if not items:
            return 0
        last_seq, prev_hash = lock_head(conn, len(items))
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
        if self.checkpoint_key is not None:
            for row in rows:
                if row["seq"] % self.checkpoint_every == 0:
                    self.insert_checkpoint(conn, row["seq"], row["hash"])
        return len(rows)

    def insert_checkpoint(self, conn: sa.Connection, seq: int, head_hash: str) -> None:
        """Sign (seq, head_hash) with the checkpoint key and store it."""
        conn.execute(sa.insert(AuditCheckpoint).values(
            checkpoint_row(self.checkpoint_key or b"", seq, head_hash, utcnow())))


def lock_head(conn: sa.Connection, count: int) -> tuple[int, str]:
    """Lock the chain head and advance it by *count*: (the new last seq, the hash before this append)."""
    return tuple(conn.execute(_LOCK_HEAD, {"count": count}).one())  # type: ignore[return-value]
