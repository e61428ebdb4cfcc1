"""Database engines (store/engine.py): SQLite files in WAL mode, one in-memory database across threads,
PostgreSQL through psycopg 3."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from store.engine import make_engine
from store.keys import KeyStore
from store.migrate import create_schema


def test_sqlite_makes_its_folder_and_uses_wal(tmp_path):
    path = tmp_path / "not" / "yet" / "there.db"
    engine = make_engine(f"sqlite:///{path}")
    create_schema(engine)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()
    assert path.exists()


def test_in_memory_sqlite_is_one_database_across_threads():
    engine = make_engine("sqlite://")
    create_schema(engine)
    keys = KeyStore(engine)
    _, plaintext = keys.create("bot", "caller")
    with ThreadPoolExecutor(max_workers=2) as pool:
        assert pool.submit(keys.verify, plaintext).result() is not None
    engine.dispose()


@pytest.mark.parametrize("url", ["postgresql://u:p@db.example/x", "postgres://u@db.example/x",
                                 "postgresql+psycopg://u@db.example/x"])
def test_postgresql_urls_use_psycopg(url):
    engine = make_engine(url)  # connects lazily: nothing is reached here
    assert engine.dialect.driver == "psycopg"
    assert engine.url.drivername == "postgresql+psycopg"
