"""A fresh PostgreSQL schema on the test server (127.0.0.1:5432; ``TEST_POSTGRES_URL``), dropped after use;
its absence fails the test loudly."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from store.engine import make_engine

POSTGRES_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@contextlib.contextmanager
def fresh_schema_url() -> Iterator[str]:
    """A URL whose connections see only a fresh schema, dropped afterwards."""
    schema = f"inferline_test_{uuid.uuid4().hex[:12]}"
    base = make_url(POSTGRES_URL).update_query_dict({"connect_timeout": "5"})
    admin = make_engine(base.render_as_string(hide_password=False))
    unreachable = None
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    except sa.exc.OperationalError as exc:
        unreachable = str(exc.orig).strip()
    if unreachable is not None:
        admin.dispose()
        pytest.fail(f"PostgreSQL at {base.render_as_string()} is unreachable:\n{unreachable}\nStart it, "
                    "or deselect these tests with -m 'not integration'.", pytrace=False)
    try:
        yield base.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
