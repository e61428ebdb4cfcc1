"""The tamper-evident audit log, behind this facade: outside store.audit, code imports from here, never from a
module inside (import-linter's "audit facade" contract); inside, the modules import one another directly.

    store = AuditStore(engine, spool_path=Path("var/audit.spool"))   # writer, reader and maintenance
    store.query(AuditFilters(pipeline="support"))

The rooms: store.py (:class:`AuditStore`, the three parts over one engine), writer.py, reader.py and
maintenance.py (the parts); chain.py (a record's canonical form and hash), append.py and locking_append.py
(chaining onto the head), verify.py, prune.py; query.py, filters.py, access.py and report.py (reading);
signing.py, anchors.py and vault.py (keys, digests outside the database, encrypted content); spool.py and
journal.py (records not in the database yet); models.py (the tables). Imports nothing of ours outside store.
"""

from __future__ import annotations

from store.audit.access import ACCESS_FIELDS, AccessFilters, parse_access_filters
from store.audit.anchors import Anchors, verify_anchors
from store.audit.chain import json_line, normalize
from store.audit.filters import (
    FILTER_FIELDS,
    RANGE_FIELDS,
    TIME_HELP,
    AuditFilters,
    parse_cost,
    parse_filters,
    parse_time,
)
from store.audit.journal import Journal, leftover_journals
from store.audit.maintenance import AuditMaintenance, ErasureReport
from store.audit.models import STATUSES
from store.audit.prune import PruneReport
from store.audit.query import MAX_LIMIT, SORT_FIELDS, Page
from store.audit.reader import AuditReader
from store.audit.signing import (
    Ed25519Signer,
    HmacSigner,
    Signer,
    Verifier,
    generate_pem,
    load_or_create,
    load_public_key,
)
from store.audit.spool import Spool
from store.audit.store import AuditStore
from store.audit.vault import ContentVault, VaultError, parse_master_key
from store.audit.verify import Finding, Tail, VerifyReport, age_text
from store.audit.writer import AuditUnavailable, AuditWriter, Item

__all__ = [
    "ACCESS_FIELDS", "FILTER_FIELDS", "MAX_LIMIT", "RANGE_FIELDS", "SORT_FIELDS", "STATUSES", "TIME_HELP",
    "AccessFilters", "Anchors", "AuditFilters", "AuditMaintenance", "AuditReader", "AuditStore", "AuditUnavailable",
    "AuditWriter", "ContentVault", "Ed25519Signer", "ErasureReport", "Finding", "HmacSigner", "Item", "Journal",
    "Page", "PruneReport", "Signer", "Spool", "Tail", "VaultError", "Verifier", "VerifyReport", "age_text",
    "generate_pem", "json_line", "leftover_journals", "load_or_create", "load_public_key", "normalize",
    "parse_access_filters", "parse_cost", "parse_filters", "parse_master_key", "parse_time", "verify_anchors",
]
