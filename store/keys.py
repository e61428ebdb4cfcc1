"""API keys for the HTTP API, stored hashed.

A key reads ``il_<id>_<secret>``. The id is public: it names the key in lists,
logs and audit records. The secret is shown once, when the key is created; only
its SHA-256 is stored.

    keys = KeyStore(make_engine("sqlite:///inferline.db"))
    info, plaintext = keys.create("support bot", "caller")   # hand plaintext over, then forget it
    keys.create("support bot", "caller", tenant="acme")       # tenant: default, the key's name
    keys.verify(plaintext)        # KeyInfo, or None for a bad, unknown or revoked key
    keys.revoke(info.id)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import string
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column, sessionmaker

from store.db import Base, UTCDateTime, utcnow

logger = logging.getLogger(__name__)

ROLES = ("caller", "auditor", "admin")
KEY_PREFIX = "il"
ID_LENGTH = 12
MAX_NAME_LENGTH = 200
#: last_used_at is refreshed at most this often, so that verifying is not a write per request.
LAST_USED_RESOLUTION = timedelta(minutes=1)

# Ids are alphanumeric, without "_" or "-", so "il_<id>_<secret>" splits unambiguously
# even though the url-safe secret may contain "_". 62**12 ids: collisions are not a concern.
_ID_ALPHABET = string.ascii_letters + string.digits
_SECRET_BYTES = 32  # token_urlsafe(32): 256 random bits as 43 characters
_KEY_PATTERN = re.compile(rf"{KEY_PREFIX}_([A-Za-z0-9]{{{ID_LENGTH}}})_([A-Za-z0-9_-]{{43}})")
_ID_PATTERN = re.compile(rf"[A-Za-z0-9]{{{ID_LENGTH}}}")
_ROLE_CHECK = "role IN ({})".format(", ".join(f"'{role}'" for role in ROLES))


class ApiKey(Base):
    """One API key. The secret itself is never stored."""

    __tablename__ = "api_keys"
    __table_args__ = (sa.CheckConstraint(_ROLE_CHECK, name="role"),)

    id: Mapped[str] = mapped_column(sa.String(ID_LENGTH), primary_key=True)
    """The public part of the key (``il_<id>_...``): safe to show, log and audit."""
    name: Mapped[str] = mapped_column(sa.String(MAX_NAME_LENGTH))
    """Who or what holds the key, for people reading lists and audits; need not be unique."""
    tenant: Mapped[str | None] = mapped_column(sa.String(MAX_NAME_LENGTH))
    """Whose requests these are (limits ``per: tenant``, fair share, cache isolation); several keys may
    share one. Set on every create (default: the name); None only in a row written by a version that
    predates the column and never backfilled, which reads as its name."""
    role: Mapped[str] = mapped_column(sa.String(16))
    """One of ROLES; a check constraint keeps other values out of the table."""
    secret_hash: Mapped[str] = mapped_column(sa.String(64))
    """Hex SHA-256 of the secret part (see _hash_secret for why a fast, unsalted hash)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    """When the key stopped working; revoked rows are kept so that audit records still resolve."""
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    """Last successful verify, to within LAST_USED_RESOLUTION; None if never used."""


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What may be shown about a key: everything but its hash."""

    id: str
    name: str
    role: str
    created_at: datetime
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None
    tenant: str = ""

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class KeyStore:
    """Create, list, revoke and verify API keys.

    Safe to share between threads (a threadpool verifying requests): every call
    opens and closes its own session. Never logs a secret.
    """

    def __init__(self, engine: sa.Engine) -> None:
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    def create(self, name: str, role: str, tenant: str | None = None) -> tuple[KeyInfo, str]:
        """A new key for *name* with *role* and *tenant* (default: *name*), and its plaintext: the only
        time it is available."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; allowed roles: {', '.join(ROLES)}")
        name = _checked("name", name, "who or what will hold it")
        tenant = name if tenant is None else _checked("tenant", tenant, "whose requests it makes")
        key_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(ID_LENGTH))
        secret = secrets.token_urlsafe(_SECRET_BYTES)
        row = ApiKey(id=key_id, name=name, tenant=tenant, role=role, secret_hash=_hash_secret(secret),
                     created_at=utcnow())
        with self._sessions.begin() as session:
            session.add(row)
        logger.info("created API key %s with role %s for tenant %s", key_id, role, tenant)
        return _info(row), f"{KEY_PREFIX}_{key_id}_{secret}"

    def list(self) -> list[KeyInfo]:
        """Every key, revoked ones included, oldest first."""
        with self._sessions() as session:
            rows = session.scalars(sa.select(ApiKey).order_by(ApiKey.created_at, ApiKey.id))
            return [_info(row) for row in rows]

    def revoke(self, key_id: str) -> bool:
        """Revoke *key_id*; False if there is no such key or it was already revoked."""
        if not isinstance(key_id, str) or not _ID_PATTERN.fullmatch(key_id):
            return False
        # One conditional UPDATE, so that two concurrent revokes cannot both return True.
        statement = (sa.update(ApiKey)
                     .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
                     .values(revoked_at=utcnow())
                     .execution_options(synchronize_session=False))
        with self._sessions.begin() as session:
            revoked = session.execute(statement).rowcount == 1
        if revoked:
            logger.info("revoked API key %s", key_id)
        return revoked

    def verify(self, plaintext: str) -> KeyInfo | None:
        """The key's info if *plaintext* is a valid, unrevoked key; else None, whatever the input."""
        match = _KEY_PATTERN.fullmatch(plaintext) if isinstance(plaintext, str) else None
        if match is None:
            return None
        key_id, secret = match.groups()
        with self._sessions.begin() as session:
            # Returning early for an unknown id leaks only whether the id exists,
            # and ids are public; the secret is compared in constant time.
            row = session.get(ApiKey, key_id)
            if row is None or row.revoked_at is not None:
                return None
            if not hmac.compare_digest(row.secret_hash.encode(), _hash_secret(secret).encode()):
                return None
            now = utcnow()
            if row.last_used_at is None or now - row.last_used_at >= LAST_USED_RESOLUTION:
                row.last_used_at = now
            return _info(row)


def public_id(plaintext: str) -> str | None:
    """The id of a well-formed key (``il_<id>_<secret>``), whether or not it exists; else None."""
    match = _KEY_PATTERN.fullmatch(plaintext)
    return match.group(1) if match else None


def _checked(what: str, value: str, meaning: str) -> str:
    value = value.strip()
    if not value:
        raise ValueError(f"a key needs a {what}: {meaning}")
    if len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"key {what} is {len(value)} characters; at most {MAX_NAME_LENGTH} allowed")
    return value


def _hash_secret(secret: str) -> str:
    # A slow, salted password hash (bcrypt, argon2) defends low-entropy secrets
    # against offline guessing. These secrets are 256 random bits: guessing one
    # from its SHA-256 is infeasible, and nobody shares a secret to precompute
    # against, so a fast hash is as safe here and keeps verify cheap per request.
    return hashlib.sha256(secret.encode()).hexdigest()


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(row.id, row.name, row.role, row.created_at, row.revoked_at, row.last_used_at,
                   row.tenant or row.name)
