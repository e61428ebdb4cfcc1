"""Opening the database (serving/runtime/database.py): the schema at head before the caller sees the
engine, and the engine disposed when the caller is done or the migration fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from serving.runtime import database
from serving.runtime.database import open_database, open_engine
from store.migrate import current_revision
from tests.postgres import fresh_schema_url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def url(request, tmp_path) -> Iterator[str]:
    """An empty database: a SQLite file in a folder not made yet, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'db' / 'inferline.db'}"
        return
    with fresh_schema_url() as url:
        yield url


def disposals(monkeypatch) -> list[sa.Engine]:
    """The engines disposed from now on, in order."""
    disposed: list[sa.Engine] = []
    real = sa.Engine.dispose
    monkeypatch.setattr(sa.Engine, "dispose", lambda engine, *a, **k: disposed.append(engine) or real(engine, *a, **k))
    return disposed


def test_open_database_migrates_first_and_disposes_after(url, monkeypatch):
    disposed = disposals(monkeypatch)
    with open_database(url) as engine:
        assert current_revision(engine) is not None
        assert "api_keys" in sa.inspect(engine).get_table_names()
        assert disposed == []
    assert disposed == [engine]


def test_open_engine_leaves_the_engine_to_its_owner(url, monkeypatch):
    disposed = disposals(monkeypatch)
    engine = open_engine(url)
    try:
        assert "audit_records" in sa.inspect(engine).get_table_names()
        assert disposed == []
    finally:
        engine.dispose()


def test_a_failed_migration_disposes_the_engine_and_raises(url, monkeypatch):

    def refuse(engine: sa.Engine) -> None:
        raise sa.exc.OperationalError("upgrade", {}, Exception("the database refused"))

    monkeypatch.setattr(database, "create_schema", refuse)
    disposed = disposals(monkeypatch)
    with pytest.raises(sa.exc.OperationalError, match="refused"), open_database(url):
        pytest.fail("the block ran without a schema")
    assert len(disposed) == 1
