"""Database engines: the one place an engine is made, for SQLite or PostgreSQL.

    engine = make_engine("sqlite:///var/inferline.db")   # or postgresql://user@host/db
    create_schema(engine)                                  # store/migrate.py: Alembic, upgrade to head

Within serving, only serving/runtime/database.py imports this (import-linter's "engine creation"
contract): the server's resources, the app's start-up checks and the CLI's commands open their database
there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import StaticPool

# Drivers we rewrite: a bare ``postgresql://`` would pick psycopg2, which is not installed.
_POSTGRES_DRIVERS = {"postgresql", "postgres"}


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
