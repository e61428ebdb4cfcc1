"""Reading the audit log: queries, summaries, export, verification, and the reviewers' access log.

    reader = AuditReader(engine)                      # checkpoint_key=... to check checkpoints too
    reader.query(AuditFilters(pipeline="support"), sort="-cost_usd", limit=50)
    reader.verify()                                   # VerifyReport(ok=True, checked=..., ...)
    reader.log_access("key-1", "auditor", "query", {"pipeline": "support"})

What a reviewer's tool needs, and nothing of the writer's (store/audit/writer.py):
no spool, no lock, and the checkpoint key only to check the checkpoints'
signatures; without one, verify still walks the whole chain. The access log is
written here, not by the writer: each entry records a reviewer's read, is
written by whoever serves that read, and is a plain row outside the chain
(no head lock, no spool), so a process that only reads can keep it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa

from store.audit.access import AccessFilters, access_page
from store.audit.chain import row_to_dict
from store.audit.filters import AuditFilters, SubjectMatch
from store.audit.models import AuditAccess
from store.audit.query import Page, export_lines, find_record_id, get_record, query_page, summarize
from store.audit.report import build_report
from store.audit.signing import Verifier, as_verifier
from store.audit.vault import ContentVault
from store.audit.verify import VerifyReport, verify_chain
from store.db import utcnow

__all__ = ["AuditReader"]


class AuditReader:
    """Queries, summarizes, exports and verifies the audit log; keeps the log of who read it. Thread-safe."""

    def __init__(self, engine: sa.Engine, *, checkpoint_key: bytes | Verifier | None = None,
                 vault: ContentVault | None = None, checkpoint_window_s: float | None = None) -> None:
        self.engine = engine
        self._verifier = as_verifier(checkpoint_key)
        #: How soon a signed checkpoint follows a record: verify reports records uncovered for longer.
        self.checkpoint_window_s = checkpoint_window_s
        #: Decrypts ``content: encrypted`` for :meth:`reveal` (the server's ``audit.master_key``).
        self.vault = vault

    def reveal(self, record: dict[str, Any], key_id: str | None, role: str | None) -> dict[str, Any]:
        """*record* with its encrypted content decrypted beside the stored ciphertext (``decrypted``:
        ``{"input", "output", "tags", "tools"}``, tools being each tool call's arguments and result; or
        ``content_erased: true`` once its subject was erased); the read is in the access log (``decrypt``). A
        record not encrypted comes back as it is."""
        if record.get("content_mode") != "encrypted":
            return record
        if self.vault is None:
            return {**record, "decrypted": None, "content_erased": None,
                    "decrypt_error": "this process has no audit.master_key to decrypt with"}
        self.log_access(key_id, role, "decrypt", {"record_id": record["id"]})
        texts = [self.vault.decrypt(record["input_content"]), self.vault.decrypt(record["output_content"])]
        erased = None in texts
        tags = record.get("tags")
        if isinstance(tags, str) and not erased:
            tags = self.vault.decrypt(tags)
            tags = None if tags is None else json.loads(tags)
        return {**record, "decrypted": None if erased else {"input": texts[0], "output": texts[1], "tags": tags,
                                                             "tools": self._tool_values(record)},
                "content_erased": erased}

    def _tool_values(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The arguments and result of each tool call of *record* (encrypted in its step), with the call's
        step and position among the record's steps."""
        found = []
        for position, stage in enumerate(record.get("stages") or ()):
            step = stage.get("step") or {}
            sealed = (step.get("tool") or {}).get("content") if isinstance(step, dict) else None
            if isinstance(sealed, str) and (text := self.vault.decrypt(sealed)) is not None:  # type: ignore[union-attr]
                found.append({"position": position, "stage_id": stage.get("stage_id"), **json.loads(text)})
        return found

    def verify(self, since: datetime | None = None, until: datetime | None = None,
               checkpoint_key: bytes | Verifier | None = None, workers: int | None = None) -> VerifyReport:
        """Check the chain (records received in [since, until), or all); checkpoints too with keys: an
        HMAC key, or a :class:`Verifier` with public keys.

        Without *checkpoint_key*, the reader's own keys (if configured) check the checkpoints.
        *workers*: processes hashing in parallel (None: one per CPU for long spans; 1: none). With keys and
        :attr:`checkpoint_window_s`, the report names the records no good checkpoint covers yet, and those
        older than the window are a ``missing_checkpoint`` finding.
        """
        return verify_chain(self.engine, since, until, as_verifier(checkpoint_key) or self._verifier, workers,
                            window_s=self.checkpoint_window_s)

    def query(self, filters: AuditFilters, *, sort: str = "-received_at", cursor: str | None = None,
              limit: int = 50) -> Page:
        """A page of matching records; ValueError for an unknown sort, a bad cursor or limit."""
        filters = self.resolved(filters)
        with self.engine.connect() as conn:
            return query_page(conn, filters, sort, cursor, limit)

    def get(self, record_id: str) -> dict[str, Any] | None:
        """One record with its key's ``key_name`` and its ``stages`` list; None if there is no such record."""
        if not isinstance(record_id, str):
            return None
        with self.engine.connect() as conn:
            return get_record(conn, record_id)

    def find_id(self, ident: str) -> str | None:
        """The id of the record of a request, by its request id or its trace id; None if there is none."""
        with self.engine.connect() as conn:
            return find_record_id(conn, ident)

    def report(self, filters: AuditFilters, anchors: Path | None = None) -> dict[str, Any]:
        """The reviewers' report over *filters*' period (store/audit/report.py), checked with this reader's
        keys and, with *anchors*, against the digest files there."""
        return build_report(self.engine, filters, self._verifier, anchors)

    def summary(self, filters: AuditFilters,
                group_by: Literal["pipeline", "model", "key_id", "day"]) -> list[dict[str, Any]]:
        """Per group: count, denied, block_rate, input/output tokens and cost_usd."""
        filters = self.resolved(filters)
        with self.engine.connect() as conn:
            return summarize(conn, filters, group_by)

    def export(self, filters: AuditFilters, fmt: Literal["jsonl", "csv"]) -> Iterator[str]:
        """Matching records (with stages) as JSON lines or CSV rows, streamed in seq order."""
        if fmt not in ("jsonl", "csv"):
            raise ValueError(f"unknown export format {fmt!r}; use jsonl or csv")
        return export_lines(self.engine, self.resolved(filters), fmt)

    def resolved(self, filters: AuditFilters) -> AuditFilters:
        """*filters* ready to select: a ``subject`` with what finds its records (its keyed hash and data keys),
        which takes this reader's vault; ValueError for a subject without one."""
        if filters.subject is None or filters.subject_match is not None:
            return filters
        if self.vault is None:
            raise ValueError("subject: its records are found by its keyed hash, which needs audit.master_key")
        match = SubjectMatch(self.vault.subject_hash(filters.subject), tuple(self.vault.key_ids(filters.subject)))
        return replace(filters, subject_match=match)

    def log_access(self, key_id: str | None, role: str | None, action: str, query: Mapping[str, Any]) -> None:
        """Record that *key_id* read the audit log (*action*, with the *query* it asked). A ``subject`` asked
        for is kept as its keyed hash (``subject_hash``; without a vault, not at all): it may name a person."""
        safe_query = {str(k): v if isinstance(v, str | int | float | bool | type(None)) else str(v)
                      for k, v in query.items() if k != "subject"}
        if query.get("subject"):
            safe_query["subject_hash"] = (self.vault.subject_hash(str(query["subject"])) if self.vault is not None
                                          else "(no audit.master_key to hash it with)")
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
