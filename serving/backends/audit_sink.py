"""The pipeline's AuditSink over the SQL audit store, plus the HTTP status of each record."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from pipeline.errors import BackendError, SpecError, SpecIssue, status_of
from serving.backends.audit_keys import exposure_window_s, public_keys
from serving.config.server import ServerSpec
from stages.audit import SEALED
from store.audit import (
    AuditStore,
    AuditUnavailable,
    ContentVault,
    Item,
    Journal,
    Signer,
    Spool,
    VaultError,
    json_line,
    leftover_journals,
    normalize,
    parse_master_key,
)
from store.db import utcnow

logger = logging.getLogger(__name__)

#: A request whose client left before the end (nginx's "client closed request").
STATUS_DISCONNECTED = 499
#: Journaled records chained per transaction, and the wait before retrying when the store refuses them.
DRAIN_BATCH = 500
DRAIN_RETRY_S = 1.0
#: How long the chaining waits after a batch is journaled (the loop sends the answers meanwhile).
DRAIN_DELAY_S = 0.002
#: At shutdown, how long the journaled records may take to reach the store.
CLOSE_TIMEOUT_S = 30.0
#: What the database says of a record it will never take (as opposed to being away, or a bug here).
REFUSED = (sa.exc.IntegrityError, sa.exc.DataError)
#: When the journal fails, how long a batch waits for the journaled records before it to be chained.
DIRECT_WAIT_S = 10.0


class StoreSink:
    """Writes audit records durably, without blocking the event loop, with group commit.

    Each ``write`` returns once its record is durable. Records that arrive
    while a batch is being made durable wait and go together in the next,
    so a burst of requests costs a few commits, not one each.

    With a *journal* (the server's default, ``audit.journal``), durable means
    in this process's write-ahead journal (store/audit/journal.py): one write
    and one fdatasync a batch. The records are chained into the store right
    after, in order, off the response's path; :meth:`flushed` waits for that
    (the audit API calls it before each read, so that a reviewer sees every
    answered request's record, or gets a 503 after 5 s). A record that neither
    the database nor its spool takes stays journaled and is retried. Without a
    journal, durable means chained (or in the store's outage spool), as the
    store's ``awrite_batch`` returns.
    """

    def __init__(self, store: AuditStore, journal: Journal | None = None):
        self.store = store
        self.journal = journal
        self._pending: list[tuple[Any, asyncio.Future[None]]] = []
        self._flushing: asyncio.Task[None] | None = None
        # Write-behind: journaled records not yet chained, and counts for flushed().
        self._unwritten: list[Item] = []
        self._draining: asyncio.Task[None] | None = None
        self._journaled = self._chained = 0
        self._progress = asyncio.Condition()
        self._closed = False

    async def write(self, record: dict[str, Any]) -> None:
        subject = record.pop("content_subject", None)
        if record.get("content_mode") == "encrypted":  # before the journal: no plain text reaches a disk
            await self._seal(record, subject or "")
        # A refusal made by the server itself (serving/http/refusals.py) brings its own status.
        record["http_status"] = record.get("http_status") or http_status(record.get("status", ""),
                                                                         record.get("error_type"))
        # Normalized here, so that a malformed record fails its own request only.
        entry = record if self.journal is None else normalize(record, utcnow())
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((entry, done))
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
        try:
            await asyncio.shield(done)  # a cancelled request still gets its record written
        except AuditUnavailable as exc:
            raise BackendError(f"the audit record could not be made durable: {exc}") from exc

    async def _seal(self, record: dict[str, Any], subject: str) -> None:
        """Encrypt the record's content and tags under *subject*'s data key, and name the subject by its keyed
        hash only; without a vault, or when the key cannot be had (the database is away), keep only hashes
        (of each tag's value, as ``content: hash`` does): the record is never lost, its plain text never kept."""
        vault, tags = self.store.vault, record.get("tags")
        texts = [record.get("input_content") or "", record.get("output_content") or "", *([tags] if tags else [])]
        # Tool calls' arguments and results (stages/audit.py SEALED), one text per call, after those.
        calls = [stage["step"]["tool"] for stage in record.get("stages", ())
                 if SEALED in stage.get("step", {}).get("tool", {})]
        texts += [json.dumps({k: call[SEALED][k] for k in ("arguments", "result")}, ensure_ascii=False)
                  for call in calls]
        try:
            if vault is None:
                raise VaultError("no audit.master_key is configured")
            if vault.has_key(subject):
                sealed = [vault.encrypt(subject, text) for text in texts]
            else:  # the data key is read (or made) in the database: off the loop
                sealed = await asyncio.to_thread(lambda: [vault.encrypt(subject, text) for text in texts])
            record["subject_hash"] = vault.subject_hash(subject)
            for call, text in zip(calls, sealed[len(sealed) - len(calls):], strict=True):
                del call[SEALED]
                call["content"] = text
        except Exception as exc:
            logger.error("audit: content not encrypted (%s: %s); the record keeps only its hashes",
                         type(exc).__name__, exc)
            record["content_mode"] = "hash"
            sealed = [_sha256(text) for text in texts[:2]]
            if tags:
                sealed.append(json.dumps({name: _sha256(value) for name, value in json.loads(tags).items()},
                                         sort_keys=True, separators=(",", ":")))
            for call in calls:
                values = call.pop(SEALED)
                call |= {k: values[k] for k in ("arguments_sha256", "result_sha256") if values[k]}
        record["input_content"], record["output_content"] = sealed[:2]
        record["tags"] = sealed[2] if tags else None

    async def flushed(self, timeout: float | None = None) -> bool:
        """Wait until every record written so far is in the store, or *timeout* seconds; whether it
        is. Without a journal a write returns only once its record is in the store: at once."""
        if self.journal is None:
            return True
        target = self._journaled + len(self._pending)
        return await self._chained_up_to(lambda: self._chained >= target or not self._busy(), timeout)

    async def _chained_up_to(self, done: Callable[[], bool], timeout: float | None) -> bool:
        async def chained() -> None:
            async with self._progress:
                await self._progress.wait_for(done)

        try:
            await asyncio.wait_for(chained(), timeout)
        except TimeoutError:
            return False
        return True

    async def aclose(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Chain what is journaled (for up to *timeout* seconds), then close the journal and the
        store's connections (the server's shutdown, after the last request). What could not be
        chained stays in the journal file, which the next start replays."""
        if self._flushing is not None:
            await asyncio.wait({self._flushing}, timeout=timeout)
        if not await self.flushed(timeout):
            logger.error("audit: %d journaled record(s) not chained at shutdown; %s keeps them for the "
                         "next start", len(self._unwritten), self.journal.path if self.journal else "?")
        self._closed = True
        if self._draining is not None and not self._draining.done():
            self._draining.cancel()
            await asyncio.gather(self._draining, return_exceptions=True)
        if self.journal is not None:
            if not self._busy():
                self.journal.truncate()
            self.journal.close()
        await self.store.aclose()

    def _busy(self) -> bool:
        return bool(self._pending or self._unwritten) or self._flushing is not None

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    if self.journal is None:
                        await self.store.awrite_batch([record for record, _ in batch])
                    else:
                        await self._journal([item for item, _ in batch])
                except Exception as exc:  # every waiter learns of it; the next batch tries again
                    for _, done in batch:
                        if not done.done():
                            done.set_exception(exc)
                else:
                    for _, done in batch:
                        if not done.done():
                            done.set_result(None)
        finally:
            self._flushing = None
            await self._notify()

    async def _journal(self, items: list[Item]) -> None:
        assert self.journal is not None
        if self._closed:
            raise AuditUnavailable("the audit log is closed (the server is shutting down)")
        lines = [json_line(*item) for item in items]
        try:
            # All chained so far: the journal is emptied first, in the same hop (off the loop).
            await asyncio.to_thread(self.journal.append, lines, empty_first=not self._unwritten)
        except OSError as exc:
            # The journal cannot take them (a full disk): chain them before answering, as without one,
            # once the journaled records before them are chained (in order; one writer at a time).
            logger.error("audit journal %s: %s; writing to the store directly", self.journal.path, exc)
            # Only the records journaled before these: writes that came in meanwhile wait in _pending
            # for this batch, and would never be chained while it waits for them.
            if not await self._chained_up_to(lambda: self._chained >= self._journaled, DIRECT_WAIT_S):
                raise AuditUnavailable(f"the journal failed ({exc}) and earlier records are not chained "
                                       f"yet") from exc
            await self.store.awrite_items(items)
            self._journaled += len(items)
            self._chained += len(items)
            return
        self._journaled += len(items)
        self._unwritten += items
        if self._draining is None or self._draining.done():
            self._draining = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        """Chain journaled records in order. Waits a moment first, so that the answers of the requests
        just made durable go out before the commit takes the loop."""
        await asyncio.sleep(DRAIN_DELAY_S)
        while self._unwritten:
            batch = self._unwritten[:DRAIN_BATCH]
            try:
                await self.store.awrite_items(batch, strict=True)
            except REFUSED as exc:  # the database refuses one of them, not for want of a database
                logger.error("audit: a batch of %d journaled record(s) was refused (%s: %s); chaining them one "
                             "by one", len(batch), type(exc).__name__, exc)
                for item in batch:
                    await self._chain_one(item)
            except Exception as exc:  # no database and no spool (AuditUnavailable), or a bug: kept, retried
                logger.error("audit: %d journaled record(s) not yet chained (%s: %s); retrying in %.0f s",
                             len(self._unwritten), type(exc).__name__, exc, DRAIN_RETRY_S)
                await asyncio.sleep(DRAIN_RETRY_S)
                continue
            del self._unwritten[:len(batch)]
            self._chained += len(batch)
            if not self._unwritten and self._flushing is None:  # all chained, and no append in flight
                assert self.journal is not None
                # In a thread, unless a batch is appended meanwhile (the next append empties it then).
                try:
                    await asyncio.to_thread(self.journal.truncate, self.journal.appends)
                except OSError as exc:  # every record in it is chained: a restart's replay skips them
                    logger.error("audit journal %s could not be emptied (%s); its records are all chained",
                                 self.journal.path, exc)
            await self._notify()

    async def _chain_one(self, item: Item) -> None:
        while True:
            try:
                await self.store.awrite_items([item], strict=True)
                return
            except REFUSED as exc:
                # The database will never take this one (a value too long for a column...): kept beside
                # the journal for an operator, never silently dropped.
                assert self.journal is not None
                Spool(self.journal.path).reject(json.loads(json_line(*item)), f"{type(exc).__name__}: {exc}")
                return
            except Exception:
                await asyncio.sleep(DRAIN_RETRY_S)

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def http_status(status: str, error_type: str | None) -> int:
    if status == "ok":
        return 200
    if status == "disconnected":
        return STATUS_DISCONNECTED
    return status_of(error_type or "")


def open_store(server: ServerSpec, root: Path, engine: sa.Engine, signer: Signer | None) -> AuditStore:
    """The audit store of *server*'s config (spool path relative to *root*, the config's folder), signing
    checkpoints with *signer* (``serving_signer`` for a serving process, else ``checkpoint_signer``)."""
    audit = server.audit
    return AuditStore(engine, spool_path=root / Path(audit.spool), mode=audit.mode,
                      checkpoint_key=signer, checkpoint_every=audit.checkpoint_every,
                      public_keys=public_keys(server, root), vault=content_vault(server, engine),
                      checkpoint_window_s=exposure_window_s(server))


def content_vault(server: ServerSpec, engine: sa.Engine | None) -> ContentVault | None:
    """The vault of ``audit.master_key`` (None without one); SpecError for a key that is not 32 bytes, or,
    with *engine*, one that does not unwrap the data keys already there (blocking)."""
    text = server.audit.master_key
    if not text:
        return None
    try:
        key = parse_master_key(text)
    except ValueError as exc:
        raise SpecError([SpecIssue("inferline.yaml", 1, 1, "audit.master_key", str(exc))]) from None
    if engine is None:
        return None
    vault = ContentVault(engine, key)
    try:
        vault.check()
    except VaultError as exc:
        raise SpecError([SpecIssue("inferline.yaml", 1, 1, "audit.master_key", f"{exc}: start with the master "
                                   "key the log was written with")]) from None
    return vault


def open_sink(server: ServerSpec, root: Path, store: AuditStore) -> StoreSink:
    """The server's sink over *store*: with ``audit.journal`` set (the default), first chains what
    processes that are gone left in their journals, then opens this process's own. Blocking."""
    prefix = server.audit.journal
    if prefix is None:
        return StoreSink(store)
    path = root / Path(prefix)
    for leftover in leftover_journals(path):
        try:
            added = store.replay_file(leftover)
        except Exception as exc:  # kept where it is for an operator (and the next start); not fatal
            logger.error("audit: the journal %s, left by a process that stopped, could not be chained (%s: %s)",
                         leftover, type(exc).__name__, exc)
            continue
        logger.info("audit: chained %d record(s) from %s, left by a process that stopped", added, leftover)
    try:
        journal = Journal.open(path)
    except OSError as exc:
        logger.error("audit journal %s cannot be opened (%s); each request waits for its record to be "
                     "chained", path, exc)
        return StoreSink(store)
    return StoreSink(store, journal)
