"""``audit:`` of ``inferline.yaml``: the tamper-evident audit log's durability, keys, refusals and anchors."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt

from pipeline.spec import Strict


class RefusalsSpec(Strict):
    """How many refused requests (401, 403, 413, 429) the server records; beyond these token buckets a
    refusal is only counted (``inferline_audit_refusals_dropped_total``), so a flood cannot fill the log."""

    #: Per client address and reason: up to this many records in a burst, refilled at this rate a minute.
    per_client_per_minute: PositiveInt = 60
    #: All clients and reasons together.
    per_minute: PositiveInt = 600


class AnchorsSpec(Strict):
    """Where each checkpoint is also delivered, as a signed digest the database's writers cannot rewrite."""

    #: Folder of digest files, one per checkpoint (``<seq>.json``, never overwritten): mount it from a
    #: separate volume or write-once storage that the database's administrators cannot write.
    dir: str
    #: Also POST each digest, as JSON, to this URL (a log archive, a transparency service).
    url: str | None = None
    #: How often new checkpoints are looked for and delivered, in seconds; a failed delivery is retried then.
    every_s: float = Field(2.0, gt=0, le=3600)


class AuditSpec(Strict):
    """The tamper-evident audit log (records go to ``database:``)."""

    #: best_effort: while the database is away, records wait in the spool file;
    #: required: new requests get 503 while records cannot be made durable.
    mode: Literal["best_effort", "required"] = "best_effort"
    #: Append-only file for records written while the database is unreachable.
    spool: str = "audit-spool.jsonl"
    #: Each server process's write-ahead journal, ``<journal>.<pid>-<random>.jsonl``: a request is answered once
    #: its record is there (fsynced), and the record is chained into the database right after, off the
    #: response's path; a restart chains what a stopped process left. null: answer only once chained.
    journal: str | None = "audit-journal"
    #: Ed25519 private key (PEM, ``inferline audit keygen``) that signs checkpoints and digests, so that a
    #: reviewer verifies with the public key alone; set it by INFERLINE_AUDIT__SIGNING_KEY(_FILE).
    signing_key: str | None = None
    #: Public keys (PEM files) of earlier signing keys: their checkpoints keep verifying after a rotation.
    public_keys: list[str] = Field(default_factory=list)
    #: HMAC key for signed checkpoints (before Ed25519; still verifies old ones, signs when no
    #: signing_key is set); better set by INFERLINE_AUDIT__CHECKPOINT_KEY(_FILE).
    checkpoint_key: str | None = None
    #: Records between signed checkpoints (at multiples of it, by a writer that holds the key).
    checkpoint_every: PositiveInt = 1000
    #: Seconds between signed checkpoints at the chain head while records come in, whoever appended them (a
    #: serving process that holds the key signs them): the newest records are anchored within
    #: ``checkpoint_every_s + anchors.every_s``.
    checkpoint_every_s: float = Field(2.0, gt=0, le=3600)
    #: With no signing_key or checkpoint_key and a SQLite file database, a serving process signs with a key of its
    #: own, made on first start beside the database (``<name>-audit-signing.pem``, mode 0600, and its ``.pub``),
    #: and delivers digests to ``<name>-audit-digests/`` beside it unless ``anchors`` names a folder. false:
    #: nothing is signed without a key.
    local_key: bool = True
    #: 32 bytes (base64 or hex) that wrap the per-subject data keys of ``content: encrypted``; set it by
    #: INFERLINE_AUDIT__MASTER_KEY(_FILE). Losing it loses that content; a wrong one stops the server.
    master_key: str | None = None
    #: How many refused requests are recorded.
    refusals: RefusalsSpec = Field(default_factory=RefusalsSpec)
    #: Deliver every checkpoint outside the database as well (null: only in the database).
    anchors: AnchorsSpec | None = None
