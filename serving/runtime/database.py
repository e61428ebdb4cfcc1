"""Opening the SQL database: within serving, the one place that makes an engine or migrates the schema
(import-linter's "engine creation" contract keeps store.engine and store.migrate to serving.runtime).

    with open_database(workspace.database_url) as engine:   # schema at head; disposed on the way out
        KeyStore(engine).list()
    engine = open_engine(url)                                # the same, for an owner that disposes it itself

The server's resources, the CLI's commands and the app's start-up checks all open it here, so every one
of them migrates the same way before it reads or writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

from store.engine import make_engine
from store.migrate import create_schema


def open_engine(url: str) -> sa.Engine:
    """An engine on *url* with the schema brought up to date (Alembic, upgrade to head); the caller disposes
    it. A failed migration disposes it and raises."""
    engine = make_engine(url)
    try:
        create_schema(engine)
    except BaseException:
        engine.dispose()
        raise
    return engine


@contextmanager
def open_database(url: str) -> Iterator[sa.Engine]:
    """:func:`open_engine` for the length of a ``with`` block."""
    engine = open_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()
