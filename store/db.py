"""SQL plumbing shared by every store: the declarative base, engines and the schema.

    engine = make_engine("sqlite:///var/inferline.db")   # or postgresql://user@host/db
    create_schema(engine)                                  # Alembic: upgrade to head

Models of all stores (API keys, audit records...) subclass :class:`Base`, so one
``MetaData`` holds the whole schema. Nothing here knows about any one table.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Dialect, make_url
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.pool import StaticPool

# Deterministic constraint names, so that Alembic revisions can name (and drop)
# constraints identically on SQLite and PostgreSQL.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Drivers we rewrite: a bare ``postgresql://`` would pick psycopg2, which is not installed.
_POSTGRES_DRIVERS = {"postgresql", "postgres"}


class Base(DeclarativeBase):
    """The declarative base of every Inferline table."""

    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class UTCDateTime(sa.TypeDecorator[datetime]):
    """A timezone-aware UTC ``datetime`` on every backend.

    PostgreSQL stores ``timestamptz``; SQLite has no time zones, so values are
    stored as naive UTC and come back tagged as UTC. Naive datetimes are refused
    on the way in rather than guessed at.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value.isoformat()}: pass a timezone-aware one")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    """Now, timezone-aware, in UTC."""
    return datetime.now(UTC)


def make_engine(url: str) -> sa.Engine:
    """An engine for *url*: ``sqlite:///path.db`` or ``postgresql[+psycopg]://...``.

    SQLite: the file's folder is created if missing, connections may cross
    threads (a threadpool serves requests) and the journal is WAL, so readers
    do not block the writer. PostgreSQL always goes through psycopg 3.
    """
    parsed = make_url(url)
    if parsed.drivername in _POSTGRES_DRIVERS:
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed)
    # pre_ping: a server restart or idle timeout must not fail the next request.
    return sa.create_engine(parsed, pool_pre_ping=True)


def _sqlite_engine(url: URL) -> sa.Engine:
    database = url.database or ""
    in_memory = database in ("", ":memory:") or url.query.get("mode") == "memory"
    options: dict[str, Any] = {"connect_args": {"check_same_thread": False}}
    if in_memory:
        # Every new connection to ":memory:" is a new, empty database: share one.
        options["poolclass"] = StaticPool
    elif not database.startswith("file:"):
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url, **options)

    @sa.event.listens_for(engine, "connect")
    def _configure(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            if not in_memory:
                cursor.execute("PRAGMA journal_mode=WAL")
                # Safe with WAL (no corruption on power loss, only the last commits may roll back)
                # and it drops the fsync per commit that the audit log's per-request write can't afford.
                cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()

    return engine
