"""Alembic environment: runs on the connection that store.migrate hands over.

Configured in code (store/migrate.py), so no alembic.ini is needed at runtime.
``target_metadata`` is every Inferline table, which autogenerate compares against.
"""

from __future__ import annotations

from alembic import context

from store.db import Base
from store.engine import make_engine

target_metadata = Base.metadata
_OPTIONS = {"target_metadata": target_metadata, "compare_type": True, "render_as_batch": True}


def _run(connection) -> None:
    context.configure(connection=connection, **_OPTIONS)
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if context.is_offline_mode():
    context.configure(url=context.config.get_main_option("sqlalchemy.url"), literal_binds=True, **_OPTIONS)
    with context.begin_transaction():
        context.run_migrations()
elif connection is not None:
    _run(connection)
else:
    engine = make_engine(context.config.get_main_option("sqlalchemy.url"))
    try:
        with engine.begin() as own_connection:
            _run(own_connection)
    finally:
        engine.dispose()
