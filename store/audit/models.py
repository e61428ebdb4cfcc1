"""Tables of the tamper-evident audit log (see store/audit/store.py for the API over them).

``audit_records`` is a hash chain: each row's ``hash`` is SHA-256 over the
previous row's hash and the row's canonical JSON (store/audit/chain.py), in
``seq`` order. ``audit_chain_head`` holds the chain's last seq and hash in one
row that writers lock, so that seq and prev_hash stay consistent across
processes. Schema changes go through Alembic revisions in store/migrations.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from store.db import Base, UTCDateTime

STATUSES = ("ok", "denied", "failed", "disconnected")
CONTENT_MODES = ("full", "redacted", "hash", "encrypted")
KINDS = ("record", "prune")
#: prev_hash of the first record of a chain.
GENESIS_HASH = "0" * 64
#: The one row of audit_chain_head.
HEAD_ID = 1


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return "{} IN ({})".format(column, ", ".join(f"'{value}'" for value in values))


class AuditRecord(Base):
    """One request (``kind="record"``), or a prune marker (``kind="prune"``), in the chain."""

    __tablename__ = "audit_records"
    __table_args__ = (
        sa.CheckConstraint(_one_of("status", STATUSES), name="status"),
        sa.CheckConstraint(_one_of("content_mode", CONTENT_MODES), name="content_mode"),
        sa.CheckConstraint(_one_of("kind", KINDS), name="kind"),
        # Retention prunes per pipeline by age; listings filter a pipeline over a time range.
        sa.Index("ix_audit_records_pipeline_received_at", "pipeline", "received_at"),
    )

    id: Mapped[str] = mapped_column(sa.String(36), primary_key=True)
    """UUIDv7 (time-ordered); given by the writer, so a spooled record keeps its id through replay."""
    seq: Mapped[int] = mapped_column(sa.BigInteger, unique=True)
    """Position in the chain, 1, 2, ...; assigned by the store under the chain-head lock."""
    prev_hash: Mapped[str] = mapped_column(sa.String(64))
    """The previous record's hash (GENESIS_HASH for seq 1)."""
    hash: Mapped[str] = mapped_column(sa.String(64))
    """Hex SHA-256 of prev_hash + this row's canonical JSON (everything but hash and legal_hold)."""
    kind: Mapped[str] = mapped_column(sa.String(16))
    """``record``, or ``prune``: a marker that accounts for the records a prune deleted."""
    received_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    first_token_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    completed_at: Mapped[datetime] = mapped_column(UTCDateTime())
    duration_ms: Mapped[float] = mapped_column(sa.Float, index=True)
    ttft_ms: Mapped[float | None] = mapped_column(sa.Float)
    """Time to first token as the client saw it; None when no token was sent."""
    key_id: Mapped[str | None] = mapped_column(sa.String(64), index=True)
    """Public id of the API key that called (never the secret); None with auth off."""
    role: Mapped[str | None] = mapped_column(sa.String(16))
    client_addr: Mapped[str | None] = mapped_column(sa.String(64))
    pipeline: Mapped[str] = mapped_column(sa.String(200))
    pipeline_version: Mapped[str] = mapped_column(sa.String(64))
    spec_sha256: Mapped[str] = mapped_column(sa.String(64), index=True)
    """SHA-256 of the pipeline's YAML as loaded: which exact spec served the request."""
    model: Mapped[str | None] = mapped_column(sa.String(200), index=True)
    weights_hash: Mapped[str | None] = mapped_column(sa.String(64))
    """Hash of the model weights that answered, so an answer can be tied to exact weights."""
    params: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    """Sampling parameters: temperature, top_p, max_tokens, seed, n (the end user is a tag: ``tags``)."""
    input_tokens: Mapped[int] = mapped_column(sa.Integer)
    output_tokens: Mapped[int] = mapped_column(sa.Integer)
    cost_usd: Mapped[float] = mapped_column(sa.Float, index=True)
    route: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)
    """The route stage's decision, reason and fallbacks tried."""
    retrieval: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)
    """Index name and version, document ids and scores the answer was grounded on."""
    policy: Mapped[list[dict[str, Any]]] = mapped_column(sa.JSON)
    """Every policy decision: rule, category, action, score."""
    policy_action: Mapped[str | None] = mapped_column(sa.String(32), index=True)
    """The strongest action in ``policy``, denormalised so that it can be filtered on."""
    policy_categories: Mapped[str] = mapped_column(sa.String(500))
    """Categories in ``policy``, sorted and comma-joined, for filtering (match ``,cat,``)."""
    status: Mapped[str] = mapped_column(sa.String(16), index=True)
    finish_reason: Mapped[str | None] = mapped_column(sa.String(32))
    http_status: Mapped[int | None] = mapped_column(sa.Integer)
    error_type: Mapped[str | None] = mapped_column(sa.String(100))
    content_mode: Mapped[str] = mapped_column(sa.String(16))
    """How input/output_content were stored: full text, redacted text, or SHA-256 only."""
    input_content: Mapped[str] = mapped_column(sa.Text)
    output_content: Mapped[str] = mapped_column(sa.Text)
    request_id: Mapped[str | None] = mapped_column(sa.String(64), index=True)
    trace_id: Mapped[str | None] = mapped_column(sa.String(64))
    pruned: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)
    """Prune markers only: the seq ranges deleted and the hashes that link over each range."""
    legal_hold: Mapped[bool] = mapped_column(sa.Boolean)
    """Kept by prune whatever its age; outside the hash, so that holds can change."""
    tags: Mapped[str | None] = mapped_column(sa.Text)
    """The request's tags as JSON text, kept as its content is: as sent (``full``), redacted, each value's
    SHA-256 (``hash``), or encrypted with the content (``encrypted``); NULL when it sent none."""
    subject_hash: Mapped[str | None] = mapped_column(sa.String(64), index=True)
    """``content: encrypted`` only: the keyed hash of the subject (store/audit/vault.py), by which erasure and
    the subject filter find its records; never the subject itself."""


class AuditStage(Base):
    """One stage of a record's pipeline run (in a workflow, one attempt of one step), in the run's order."""

    __tablename__ = "audit_stages"

    record_id: Mapped[str] = mapped_column(sa.ForeignKey("audit_records.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    stage_id: Mapped[str] = mapped_column(sa.String(100))
    type: Mapped[str] = mapped_column(sa.String(100))
    status: Mapped[str] = mapped_column(sa.String(32))
    duration_ms: Mapped[float] = mapped_column(sa.Float)
    cost_usd: Mapped[float] = mapped_column(sa.Float)
    decision: Mapped[Any | None] = mapped_column(sa.JSON)
    """What the stage decided (policy verdict, route taken...), if it decides anything."""
    step: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON(none_as_null=True))
    """Which attempt of which step this row is: when it started, its tokens, why it was skipped, the SHA-256 of its
    definition, inputs and output, and with ``content: full`` those values (stages/audit.py ``step_record``);
    NULL for rows written before revision 0013, which the chain then hashes as it did."""


class AuditCheckpoint(Base):
    """A signature over the chain head at some seq: truncating or rewriting the tail shows."""

    __tablename__ = "audit_checkpoints"

    seq: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    head_hash: Mapped[str] = mapped_column(sa.String(64))
    signature: Mapped[str] = mapped_column(sa.String(128))
    """Hex signature over ``"<seq>:<head_hash>"``: Ed25519 with the signing key, or HMAC (store/audit/signing.py)."""
    algorithm: Mapped[str] = mapped_column(sa.String(32))
    key_id: Mapped[str] = mapped_column(sa.String(64), server_default=sa.text("''"))
    """Which Ed25519 key signed it (its public key's id); empty for HMAC."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class AuditChainHead(Base):
    """The chain's last seq and hash, in a single row (id HEAD_ID) that each writer locks."""

    __tablename__ = "audit_chain_head"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(sa.BigInteger)
    hash: Mapped[str] = mapped_column(sa.String(64))


class AuditAccess(Base):
    """Who read the audit log, and how: auditors are audited too."""

    __tablename__ = "audit_access_log"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    key_id: Mapped[str | None] = mapped_column(sa.String(64))
    role: Mapped[str | None] = mapped_column(sa.String(16))
    action: Mapped[str] = mapped_column(sa.String(64))
    query: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    """The filters, sort and cursor asked for, as given."""
