"""The pipeline's AuditSink over the SQL audit store, plus the HTTP status of each record."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from pipeline.errors import BackendError
from serving.problems import status_of
from serving.wiring import Workspace
from store.audit import AuditStore, AuditUnavailable

#: A request whose client left before the end (nginx's "client closed request").
STATUS_DISCONNECTED = 499


class StoreSink:
    """Writes audit records durably, without blocking the event loop, with group commit.

    Each ``write`` returns once its record is durable. Records that arrive
    while a batch is being committed wait and go together in the next
    transaction, so a burst of requests costs a few commits, not one each.
    """

    def __init__(self, store: AuditStore):
        self.store = store
        self._pending: list[tuple[dict[str, Any], asyncio.Future[None]]] = []
        self._flushing = False

    async def write(self, record: dict[str, Any]) -> None:
        record["http_status"] = http_status(record.get("status", ""), record.get("error_type"))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((record, done))
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().create_task(self._flush())
        try:
            await asyncio.shield(done)  # a cancelled request still gets its record written
        except AuditUnavailable as exc:
            raise BackendError(f"the audit record could not be made durable: {exc}") from exc

    async def aclose(self) -> None:
        """Close the store's connections (the server's shutdown, after the last request)."""
        await self.store.aclose()

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await self.store.awrite_batch([record for record, _ in batch])
                except Exception as exc:  # every waiter learns of it; the next batch tries again
                    for _, done in batch:
                        if not done.done():
                            done.set_exception(exc)
                else:
                    for _, done in batch:
                        if not done.done():
                            done.set_result(None)
        finally:
            self._flushing = False


def http_status(status: str, error_type: str | None) -> int:
    if status == "ok":
        return 200
    if status == "disconnected":
        return STATUS_DISCONNECTED
    return status_of(error_type or "")


def open_store(workspace: Workspace, engine: sa.Engine) -> AuditStore:
    """The audit store of *workspace*'s config (spool path relative to the config's folder)."""
    audit = workspace.server.audit
    key = audit.checkpoint_key.encode() if audit.checkpoint_key else None
    return AuditStore(engine, spool_path=workspace.root / Path(audit.spool), mode=audit.mode,
                      checkpoint_key=key, checkpoint_every=audit.checkpoint_every)
