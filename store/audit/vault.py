"""Encrypted audit content, erasable per subject: crypto-shredding that keeps the chain.

    vault = ContentVault(engine, master_key)           # audit.master_key: 32 bytes (base64 or hex)
    text = vault.encrypt("tenant:acme", "the prompt")  # "enc:v1:<data key id>:<nonce+ciphertext, base64>"
    vault.decrypt(text)                                # the prompt; None once the subject is erased
    vault.subject_hash("tenant:acme")                  # the keyed hash that records keep of their subject
    vault.erase("tenant:acme", by="key-id")            # the subject's data key destroyed

Each subject (a tenant, an API key, or a value the pipeline names, such as the request's user) has its
own data key (AES-256-GCM), stored wrapped by the master key in ``audit_data_keys`` under the subject's
keyed hash (:meth:`ContentVault.subject_hash`: the subject itself may be personal data, and a plain
hash of a name is found by hashing names). A record with ``content: encrypted`` keeps its input,
output and tags encrypted under that key and the subject's keyed hash in clear (``subject_hash``, which
finds and counts the subject's records); the chain hashes the ciphertext, so destroying the data key
makes the content unreadable while every hash, and so the chain, still verifies.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import threading
import time
from datetime import datetime

import sqlalchemy as sa
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy.orm import Mapped, Session, mapped_column

from store.db import Base, UTCDateTime, utcnow

PREFIX = "enc:v1:"
#: What the key of subject hashes is derived from the master key with (HMAC-SHA256 of this under the master key):
#: a key of its own, so that the master key is used for one thing only, wrapping data keys.
_SUBJECT_HASH_KEY = b"inferline-audit-subject-hash"
#: How long a process encrypts with a subject's key before looking again whether it was erased (by
#: another process: an erasure here applies at once).
LIVE_KEY_S = 30.0


class AuditDataKey(Base):
    """A data key of a subject, wrapped by the master key; erased: the wrapped key is gone for good."""

    __tablename__ = "audit_data_keys"

    key_id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    """Named by each content it encrypted (``enc:v1:<key_id>:...``)."""
    subject_id: Mapped[str] = mapped_column(sa.String(64), index=True)
    """The subject's keyed hash (:meth:`ContentVault.subject_hash`); a key made before hashes were keyed has
    :func:`legacy_subject_id` until its subject is named again (an encryption or an erasure renames it)."""
    wrapped: Mapped[str | None] = mapped_column(sa.Text)
    """Base64 of the nonce and the AES-GCM ciphertext of the data key; NULL once erased."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    erased_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    erased_by: Mapped[str | None] = mapped_column(sa.String(200))


class VaultError(Exception):
    """The master key is wrong, or a ciphertext was altered."""


def parse_master_key(text: str) -> bytes:
    """32 bytes from base64 or hex; ValueError otherwise."""
    value = text.strip()
    for decode in (bytes.fromhex, lambda v: base64.b64decode(v, validate=True)):
        try:
            key = decode(value)
        except (ValueError, binascii.Error):
            continue
        if len(key) == 32:
            return key
    raise ValueError("the master key must be 32 bytes, as 64 hex digits or base64 "
                     "(python -c 'import os,base64; print(base64.b64encode(os.urandom(32)).decode())')")


def legacy_subject_id(subject: str) -> str:
    """What data keys made before subject hashes were keyed name their subject by: a plain SHA-256, which
    anyone can compute for a guessed name (hence :meth:`ContentVault.subject_hash`)."""
    return hashlib.sha256(f"inferline-audit-subject\0{subject}".encode()).hexdigest()


def key_of(text: str) -> str | None:
    """The data key id an encrypted content names; None for text that is not encrypted content."""
    if not text.startswith(PREFIX):
        return None
    return text[len(PREFIX):].split(":", 1)[0]


class ContentVault:
    """Data keys per subject, wrapped by the master key; thread-safe."""

    def __init__(self, engine: sa.Engine, master_key: bytes):
        self.engine = engine
        self._master = AESGCM(master_key)
        self._hash_key = hmac.new(master_key, _SUBJECT_HASH_KEY, hashlib.sha256).digest()
        #: What encrypting uses, for up to LIVE_KEY_S seconds: key id -> data key; subject id -> its key id.
        self._keys: dict[str, bytes | None] = {}
        self._live: dict[str, str] = {}
        self._since: dict[str, float] = {}
        self._lock = threading.Lock()

    def check(self) -> None:
        """Raise :class:`VaultError` when the master key does not unwrap the stored data keys (a wrong key
        would write content no one can read back)."""
        with Session(self.engine) as session:
            row = session.scalars(sa.select(AuditDataKey).where(AuditDataKey.wrapped.is_not(None)).limit(1)).first()
        if row is not None:
            self._unwrap(row.key_id, row.wrapped or "")

    def subject_hash(self, subject: str) -> str:
        """What the database keeps of *subject*: HMAC-SHA256 under a key derived from the master key, hex.
        Equal for equal subjects, so it finds and counts a subject's records; without the master key it
        tells nothing of who the subject is, and no guessed name can be checked against it."""
        return hmac.new(self._hash_key, subject.encode(), hashlib.sha256).hexdigest()

    def has_key(self, subject: str) -> bool:
        """Whether encrypting for *subject* needs no database read now (its key is at hand)."""
        sid = self.subject_hash(subject)
        with self._lock:
            key_id = self._live.get(sid)
            return key_id is not None and self._keys.get(key_id) is not None \
                and time.monotonic() - self._since.get(sid, 0.0) < LIVE_KEY_S

    def encrypt(self, subject: str, text: str) -> str:
        key_id, key = self._live_key(subject)
        nonce = os.urandom(12)
        sealed = AESGCM(key).encrypt(nonce, text.encode(), key_id.encode())
        return f"{PREFIX}{key_id}:{base64.b64encode(nonce + sealed).decode()}"

    def decrypt(self, text: str) -> str | None:
        """The plain text of encrypted content; None when its subject was erased. Text that is not
        encrypted content comes back as it is."""
        key_id = key_of(text)
        if key_id is None:
            return text
        key = self._key(key_id)
        if key is None:
            return None
        blob = base64.b64decode(text[len(PREFIX) + len(key_id) + 1:])
        try:
            return AESGCM(key).decrypt(blob[:12], blob[12:], key_id.encode()).decode()
        except InvalidTag:
            raise VaultError("encrypted content does not decrypt: it was altered, or its key replaced") from None

    def key_ids(self, subject: str) -> list[str]:
        """Every data key *subject* has had (erased ones too)."""
        with Session(self.engine) as session:
            return list(session.scalars(sa.select(AuditDataKey.key_id)
                                        .where(AuditDataKey.subject_id.in_(self._subject_ids(subject)))))

    def erase(self, subject: str, by: str, conn: sa.Connection | None = None) -> list[str]:
        """Destroy every data key of *subject* (on *conn*, in its transaction, when given); the ids of those
        that were live."""
        sid = self.subject_hash(subject)
        table = AuditDataKey.__table__
        live = sa.and_(table.c.subject_id.in_(self._subject_ids(subject)), table.c.wrapped.is_not(None))

        def run(connection: sa.Connection) -> list[str]:
            ids = list(connection.scalars(sa.select(table.c.key_id).where(live)))
            connection.execute(table.update().where(live).values(wrapped=None, erased_at=utcnow(), erased_by=by))
            self._rename_legacy(connection, subject)  # no plain hash of an erased subject stays behind
            return ids

        if conn is not None:
            destroyed = run(conn)
        else:
            with self.engine.begin() as own:
                destroyed = run(own)
        with self._lock:
            for key_id in destroyed:
                self._keys[key_id] = None
            self._live.pop(sid, None)
        return destroyed

    def _subject_ids(self, subject: str) -> tuple[str, str]:
        return self.subject_hash(subject), legacy_subject_id(subject)

    def _rename_legacy(self, conn: sa.Connection, subject: str) -> None:
        """Give *subject*'s keys made before hashes were keyed its keyed hash (a write only when there are any)."""
        table, legacy = AuditDataKey.__table__, legacy_subject_id(subject)
        if conn.scalar(sa.select(table.c.key_id).where(table.c.subject_id == legacy).limit(1)) is not None:
            conn.execute(table.update().where(table.c.subject_id == legacy)
                         .values(subject_id=self.subject_hash(subject)))

    def _live_key(self, subject: str) -> tuple[str, bytes]:
        sid = self.subject_hash(subject)
        with self._lock:
            key_id = self._live.get(sid)
            if key_id is not None and (key := self._keys.get(key_id)) is not None \
                    and time.monotonic() - self._since.get(sid, 0.0) < LIVE_KEY_S:
                return key_id, key
        with Session(self.engine) as session, session.begin():
            self._rename_legacy(session.connection(), subject)
            row = session.scalars(sa.select(AuditDataKey).where(AuditDataKey.subject_id == sid,
                                                                AuditDataKey.wrapped.is_not(None))
                                  .order_by(AuditDataKey.created_at.desc()).limit(1)).first()
            if row is not None:
                key_id, key = row.key_id, self._unwrap(row.key_id, row.wrapped or "")
            else:  # none yet, or every one erased: a new key from now on
                key_id, key = os.urandom(16).hex(), AESGCM.generate_key(256)
                nonce = os.urandom(12)
                wrapped = base64.b64encode(nonce + self._master.encrypt(nonce, key, key_id.encode())).decode()
                session.add(AuditDataKey(key_id=key_id, subject_id=sid, wrapped=wrapped, created_at=utcnow()))
        with self._lock:
            self._keys[key_id], self._live[sid], self._since[sid] = key, key_id, time.monotonic()
        return key_id, key

    def _key(self, key_id: str) -> bytes | None:
        # Read every time (reads are a reviewer's, one record at a time): a key another process erased
        # must not decrypt here from a cache.
        with Session(self.engine) as session:
            row = session.get(AuditDataKey, key_id)
            return self._unwrap(key_id, row.wrapped) if row is not None and row.wrapped is not None else None

    def _unwrap(self, key_id: str, wrapped: str) -> bytes:
        blob = base64.b64decode(wrapped)
        try:
            return self._master.decrypt(blob[:12], blob[12:], key_id.encode())
        except InvalidTag:
            raise VaultError("the master key (audit.master_key) does not unwrap the audit data keys: it is not the "
                             "key they were made with") from None
