"""Alembic revisions of the Inferline schema; run them with store.migrate.upgrade()."""
