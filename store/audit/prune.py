"""Retention: deleting old records and chaining a marker that accounts for them.

The marker is an ordinary chained record of ``kind="prune"`` whose ``pruned``
field lists each deleted seq range as ``[first, last, prev_hash, last_hash]``:
the prev_hash that led into the range and the hash of its last record. The
verifier links over a gap only when such ranges tile it exactly and their
hashes connect, so an unexplained deletion still fails.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from store.audit.chain import normalize
from store.audit.models import AuditRecord, AuditStage

_CHUNK = 500
_records = AuditRecord.__table__
_stages = AuditStage.__table__


@dataclass(frozen=True, slots=True)
class PruneReport:
    """How many records a prune deleted, and the id of the marker that accounts for them."""

    deleted: int
    marker_id: str | None


def prune_in(conn: sa.Connection, retention_days: Mapping[str, int], now: datetime,
             append: Callable[[tuple[dict[str, Any], list[dict[str, Any]]]], int]) -> PruneReport:
    """Delete expired, unheld records on *conn* (chain head already locked); append the marker with *append*."""
    cutoffs = {pipeline: retention_cutoff(now, days) for pipeline, days in retention_days.items()}
    doomed: list[tuple[int, str, str, str]] = []
    c = _records.c
    for pipeline, cutoff in cutoffs.items():
        doomed += conn.execute(sa.select(c.seq, c.id, c.prev_hash, c.hash).where(
            c.kind == "record", c.pipeline == pipeline, c.received_at < cutoff, c.legal_hold.is_(False))).all()
    if not doomed:
        return PruneReport(0, None)
    doomed.sort()
    ids = [record_id for _, record_id, _, _ in doomed]
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start:start + _CHUNK]
        conn.execute(_stages.delete().where(_stages.c.record_id.in_(chunk)))
        conn.execute(_records.delete().where(_records.c.id.in_(chunk)))
    row, stages = normalize({"pipeline": "", "status": "ok", "completed_at": now, "received_at": now,
                             "content_mode": "hash"}, now)
    row["kind"] = "prune"
    row["pruned"] = {"ranges": _ranges(doomed), "deleted": len(doomed),
                     "before": {pipeline: cutoff.isoformat() for pipeline, cutoff in sorted(cutoffs.items())}}
    append((row, stages))
    return PruneReport(len(doomed), row["id"])


def retention_cutoff(now: datetime, days: int) -> datetime:
    """The received_at before which a pipeline with *days* of retention is pruned."""
    if isinstance(days, bool) or not isinstance(days, int) or days < 0:
        raise ValueError(f"retention must be a non-negative whole number of days, got {days!r}")
    return now - timedelta(days=days)


def _ranges(doomed: list[tuple[int, str, str, str]]) -> list[list[Any]]:
    """Consecutive seqs merged: [first, last, prev_hash into first, hash of last]."""
    ranges: list[list[Any]] = []
    for seq, _, prev_hash, record_hash in doomed:
        if ranges and ranges[-1][1] == seq - 1:
            ranges[-1][1], ranges[-1][3] = seq, record_hash
        else:
            ranges.append([seq, seq, prev_hash, record_hash])
    return ranges
