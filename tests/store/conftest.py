"""Database fixtures for the store tests: SQLite in a temporary folder and a fresh
PostgreSQL schema on 127.0.0.1:5432 (its absence fails the integration tests loudly)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from store.engine import make_engine
from store.migrate import create_schema
from tests.postgres import fresh_schema_url


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'keys.db'}"


@pytest.fixture
def postgresql_url() -> Iterator[str]:
    """A URL whose connections see only a fresh schema, dropped after the test."""
    with fresh_schema_url() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def engine(request) -> Iterator[sa.Engine]:
    engine = make_engine(request.getfixturevalue(f"{request.param}_url"))
    create_schema(engine)
    yield engine
    engine.dispose()


# PostgreSQL engines for the audit append tests: one store's, and another process's.


@pytest.fixture
def pg_url(postgresql_url) -> str:
    # An application name of its own, so that a test can find (and kill) the store's connections.
    return make_url(postgresql_url).update_query_dict({"application_name": f"audit-{uuid.uuid4().hex[:8]}"}) \
        .render_as_string(hide_password=False)


@pytest.fixture
def pg(pg_url) -> Iterator[sa.Engine]:
    engine = make_engine(pg_url)
    create_schema(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def other(pg_url) -> Iterator[sa.Engine]:
    """A second engine on the same schema: another process, as far as the first store can tell."""
    engine = make_engine(pg_url)
    yield engine
    engine.dispose()
