"""Alembic revision scripts, one per schema change, applied in order by store.migrate."""
