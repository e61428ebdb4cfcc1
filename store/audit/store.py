"""The tamper-evident audit log as one object: a writer, a reader and maintenance over one engine.

    store = AuditStore(engine, spool_path=Path("var/audit.spool"), checkpoint_key=b"...")
    record_id = store.write({"pipeline": "support", "status": "ok", "stages": [...], ...})
    store.verify()                                    # VerifyReport(ok=True, checked=..., ...)
    store.query(AuditFilters(pipeline="support"), sort="-cost_usd", limit=50)
    store.prune({"support": 365})                     # deletes, then appends a chained prune marker

What the server and the audit sink hold. Each part also works alone over an engine:

- store/audit/writer.py, :class:`AuditWriter`: chaining records, the outage spool and its replay,
  journal replay, checkpoints as the chain grows.
- store/audit/reader.py, :class:`AuditReader`: queries, summaries, export, verification, and the
  reviewers' access log; no spool, and the checkpoint key only to check checkpoints.
- store/audit/maintenance.py, :class:`AuditMaintenance`: legal holds and pruning.

Here the three share the engine and the checkpoint key, and a prune's marker is chained through the
writer's lock. Each method below is its part's, documented there.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa

from store.audit.access import AccessFilters
from store.audit.filters import AuditFilters
from store.audit.maintenance import AuditMaintenance, ErasureReport
from store.audit.prune import PruneReport
from store.audit.query import Page
from store.audit.reader import AuditReader
from store.audit.signing import Signer, Verifier, as_signer
from store.audit.vault import ContentVault
from store.audit.verify import VerifyReport
from store.audit.writer import AuditWriter, Item

__all__ = ["AuditStore"]


class AuditStore:
    """Writes, verifies, queries and prunes the audit log, through :attr:`writer`, :attr:`reader` and
    :attr:`maintenance`. Thread-safe."""

    def __init__(self, engine: sa.Engine, *, spool_path: Path,
                 mode: Literal["best_effort", "required"] = "best_effort",
                 checkpoint_key: bytes | Signer | None = None, checkpoint_every: int = 1000,
                 public_keys: Sequence[bytes | str] = (), vault: ContentVault | None = None,
                 checkpoint_window_s: float | None = None) -> None:
        self.writer = AuditWriter(engine, spool_path=spool_path, mode=mode, checkpoint_key=checkpoint_key,
                                  checkpoint_every=checkpoint_every)
        self.reader = AuditReader(engine, checkpoint_key=None if checkpoint_key is None else
                                  Verifier.for_signer(as_signer(checkpoint_key), public_keys), vault=vault,
                                  checkpoint_window_s=checkpoint_window_s)
        #: Encrypts and decrypts ``content: encrypted`` (None: no ``audit.master_key``).
        self.vault = vault
        self.maintenance = AuditMaintenance.for_writer(self.writer)

    @property
    def engine(self) -> sa.Engine:
        """The database of all three parts."""
        return self.writer.engine

    @engine.setter
    def engine(self, engine: sa.Engine) -> None:
        # Repoints all three together, so that they never see two databases.
        self.writer.engine = self.reader.engine = self.maintenance.engine = engine

    @property
    def mode(self) -> Literal["best_effort", "required"]:
        """The writer's: whether a record that neither the database nor the spool takes fails its request."""
        return self.writer.mode

    # --- writing: AuditWriter ----------------------------------------------------------

    def write(self, record: Mapping[str, Any]) -> str:
        """:meth:`AuditWriter.write`."""
        return self.writer.write(record)

    def write_batch(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """:meth:`AuditWriter.write_batch`."""
        return self.writer.write_batch(records)

    async def awrite_batch(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """:meth:`AuditWriter.awrite_batch`."""
        return await self.writer.awrite_batch(records)

    async def awrite_items(self, items: list[Item], *, strict: bool = False) -> None:
        """:meth:`AuditWriter.awrite_items`."""
        await self.writer.awrite_items(items, strict=strict)

    def write_many(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """:meth:`AuditWriter.write_many`."""
        return self.writer.write_many(records)

    def replay_spool(self) -> int:
        """:meth:`AuditWriter.replay_spool`."""
        return self.writer.replay_spool()

    def replay_file(self, path: Path) -> int:
        """:meth:`AuditWriter.replay_file`."""
        return self.writer.replay_file(path)

    def is_durable(self) -> bool:
        """:meth:`AuditWriter.is_durable`."""
        return self.writer.is_durable()

    def checkpoint(self) -> dict[str, Any] | None:
        """:meth:`AuditWriter.checkpoint`."""
        return self.writer.checkpoint()

    def cover_head(self) -> int | None:
        """:meth:`AuditWriter.cover_head`."""
        return self.writer.cover_head()

    def close(self) -> None:
        """:meth:`AuditWriter.close` (the reader and maintenance hold no connection between calls)."""
        self.writer.close()

    async def aclose(self) -> None:
        """:meth:`AuditWriter.aclose`."""
        await self.writer.aclose()

    # --- checking and reading: AuditReader ---------------------------------------------

    def verify(self, since: datetime | None = None, until: datetime | None = None,
               checkpoint_key: bytes | Verifier | None = None, workers: int | None = None) -> VerifyReport:
        """:meth:`AuditReader.verify`; without *checkpoint_key*, the store's own checks the checkpoints."""
        return self.reader.verify(since, until, checkpoint_key, workers)

    def query(self, filters: AuditFilters, *, sort: str = "-received_at", cursor: str | None = None,
              limit: int = 50) -> Page:
        """:meth:`AuditReader.query`."""
        return self.reader.query(filters, sort=sort, cursor=cursor, limit=limit)

    def get(self, record_id: str) -> dict[str, Any] | None:
        """:meth:`AuditReader.get`."""
        return self.reader.get(record_id)

    def summary(self, filters: AuditFilters,
                group_by: Literal["pipeline", "model", "key_id", "day"]) -> list[dict[str, Any]]:
        """:meth:`AuditReader.summary`."""
        return self.reader.summary(filters, group_by)

    def export(self, filters: AuditFilters, fmt: Literal["jsonl", "csv"]) -> Iterator[str]:
        """:meth:`AuditReader.export`."""
        return self.reader.export(filters, fmt)

    def log_access(self, key_id: str | None, role: str | None, action: str, query: Mapping[str, Any]) -> None:
        """:meth:`AuditReader.log_access`."""
        self.reader.log_access(key_id, role, action, query)

    def access(self, filters: AccessFilters, *, cursor: str | None = None, limit: int = 50) -> Page:
        """:meth:`AuditReader.access`."""
        return self.reader.access(filters, cursor=cursor, limit=limit)

    def access_log(self, limit: int = 100) -> list[dict[str, Any]]:
        """:meth:`AuditReader.access_log`."""
        return self.reader.access_log(limit)

    # --- retention: AuditMaintenance ---------------------------------------------------

    def set_hold(self, *, pipeline: str | None = None, record_ids: list[str] | None = None, on: bool = True) -> int:
        """:meth:`AuditMaintenance.set_hold`."""
        return self.maintenance.set_hold(pipeline=pipeline, record_ids=record_ids, on=on)

    def prune(self, retention_days: Mapping[str, int], now: datetime | None = None) -> PruneReport:
        """:meth:`AuditMaintenance.prune`."""
        return self.maintenance.prune(retention_days, now)

    def erase(self, subject: str, by: str, now: datetime | None = None) -> ErasureReport:
        """:meth:`AuditMaintenance.erase` with this store's vault; ValueError without one."""
        if self.vault is None:
            raise ValueError("no audit.master_key is configured: there is no encrypted content to erase")
        return self.maintenance.erase(self.vault, subject, by, now)
