"""Alembic revisions (store/migrations): up and down on SQLite and PostgreSQL, and no drift from the models."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

import store.audit.models
import store.audit.vault
import store.counters
import store.eval_runs
import store.pipeline_versions
import store.responses  # noqa: F401  (their tables, for the drift check)
from store.db import Base
from store.engine import make_engine
from store.keys import ApiKey, KeyStore
from store.migrate import MIGRATIONS, create_schema, current_revision, downgrade, upgrade

TABLES = {"api_keys", "audit_records", "audit_stages", "audit_checkpoints", "audit_chain_head", "audit_access_log",
          "limit_counters", "pipeline_versions", "pipeline_traffic", "pipeline_shadows", "audit_data_keys", "responses",
          "paused_requests", "tool_pins"}
HEAD = "0015"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def bare_engine(request) -> Iterator[sa.Engine]:
    """An engine on an empty database (or schema): nothing migrated yet."""
    engine = make_engine(request.getfixturevalue(f"{request.param}_url"))
    yield engine
    engine.dispose()


def tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def test_up_to_head_down_to_base_and_up_again(bare_engine):
    assert current_revision(bare_engine) is None
    upgrade(bare_engine)
    assert tables(bare_engine) >= TABLES
    assert current_revision(bare_engine) == HEAD
    with bare_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id, seq, hash FROM audit_chain_head")).all() == [(1, 0, "0" * 64)]
    downgrade(bare_engine, "base")
    assert tables(bare_engine) & TABLES == set()
    assert current_revision(bare_engine) is None
    upgrade(bare_engine)
    assert tables(bare_engine) >= TABLES


def test_the_models_and_the_migrations_agree(bare_engine):
    upgrade(bare_engine)
    with bare_engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
        assert compare_metadata(context, Base.metadata) == []


def test_create_schema_is_upgrade_and_can_run_twice(bare_engine):
    create_schema(bare_engine)
    create_schema(bare_engine)
    assert current_revision(bare_engine) == HEAD


def test_a_pre_alembic_database_is_adopted_with_its_keys(bare_engine):
    Base.metadata.create_all(bare_engine, tables=[ApiKey.__table__])  # what the old create_schema made
    _, plaintext = KeyStore(bare_engine).create("bot", "caller")
    create_schema(bare_engine)
    assert tables(bare_engine) >= TABLES
    assert KeyStore(bare_engine).verify(plaintext) is not None


def test_a_revision_imports_no_other_revision_and_none_of_our_code():
    # A released revision is frozen text: what it runs must not change when another module does.
    ours = {"pipeline", "stages", "serving", "store", "tests", "importlib", "runpy"}
    found = []
    for path in sorted((MIGRATIONS / "versions").glob("[0-9]*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
                names = ["__import__"]
            else:
                continue
            found += [f"{path.name}:{node.lineno}: {name}" for name in names
                      if name == "__import__" or name.split(".")[0] in ours]
    assert found == []


@pytest.mark.integration
def test_audit_append_takes_each_revisions_columns_up_and_down(postgresql_url):
    # 0009, 0012 and 0013 replace audit_append() with their own copies of it: each step up or down leaves the
    # function that writes the columns the tables have at that revision.
    engine = make_engine(postgresql_url)

    def function() -> str:
        with engine.connect() as conn:
            return conn.scalar(sa.text("SELECT pg_get_functiondef('audit_append'::regproc)"))

    try:
        steps = [("0008", False, False, False), ("0009", True, False, False), ("0011", True, False, False),
                 ("0012", True, True, False), ("0013", True, True, True)]
        for revision, key_id, tags, step in [*steps, *reversed(steps[:-1])]:
            (upgrade if revision >= (current_revision(engine) or "") else downgrade)(engine, revision)
            text = function()
            assert ("COALESCE(c.key_id, '')" in text) is key_id, revision
            assert ("legal_hold, tags, subject_hash)" in text) is tags, revision
            assert ("cost_usd, decision, step)" in text and "'null'::json), s.step" in text) is step, revision
            assert "INSERT INTO audit_stages" in text and "json_populate_recordset(NULL::audit_records" in text
    finally:
        engine.dispose()


def test_upgrade_takes_a_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'by-url.db'}"
    upgrade(url)
    assert current_revision(url) == HEAD
    downgrade(url)
    assert current_revision(url) is None


def test_keys_made_before_tenants_keep_their_name_as_tenant(bare_engine):
    upgrade(bare_engine, "0004")
    with bare_engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO api_keys (id, name, role, secret_hash, created_at) "
                             "VALUES ('abcdefABCDEF', 'old bot', 'caller', :h, CURRENT_TIMESTAMP)"), {"h": "0" * 64})
    upgrade(bare_engine)
    [info] = KeyStore(bare_engine).list()
    assert (info.name, info.tenant) == ("old bot", "old bot")
    with bare_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT tenant FROM api_keys")).scalar_one() == "old bot"
    downgrade(bare_engine, "0004")
    assert "tenant" not in {c["name"] for c in sa.inspect(bare_engine).get_columns("api_keys")}


def test_records_chained_before_0012_still_verify_across_it(bare_engine, tmp_path):
    from store.audit import AuditStore
    from tests.store.audit.test_store import make_record

    upgrade(bare_engine)
    AuditStore(bare_engine, spool_path=tmp_path / "spool").write_batch([make_record(i) for i in range(3)])
    downgrade(bare_engine, "0011")  # the columns 0012 adds are gone, the records and their hashes stay
    assert {"tags", "subject_hash"}.isdisjoint(c["name"] for c in sa.inspect(bare_engine).get_columns("audit_records"))
    upgrade(bare_engine)
    store = AuditStore(bare_engine, spool_path=tmp_path / "spool")
    store.write(make_record(3, tags='{"user":"alice"}'))
    report = store.verify()
    assert report.ok and report.checked == 4


STEP = {"attempt": 2, "started_ms": 12.5, "skip_reason": "when", "inputs_sha256": "ab" * 32,
        "inputs": {"input": "hi", "steps.classify.output": {"intent": "tech"}}, "output": {"output": "ok"}}


def _steps(engine: sa.Engine) -> list[tuple[str, object]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT stage_id, step FROM audit_stages ORDER BY record_id, position")).all()
    return [(stage_id, None if step is None else json.loads(step) if isinstance(step, str) else step)
            for stage_id, step in rows]


def test_0013_keeps_step_data_and_records_chained_before_it_verify_across_it(bare_engine, tmp_path):
    from store.audit import AuditStore
    from tests.store.audit.test_store import make_record

    upgrade(bare_engine)
    store = AuditStore(bare_engine, spool_path=tmp_path / "spool")
    store.write_batch([make_record(i) for i in range(2)])  # chained without steps, as 0012's code chained them
    downgrade(bare_engine, "0012")
    assert "step" not in {c["name"] for c in sa.inspect(bare_engine).get_columns("audit_stages")}
    upgrade(bare_engine)
    assert [step for _, step in _steps(bare_engine)] == [None] * 4  # rows from before the column have none
    store = AuditStore(bare_engine, spool_path=tmp_path / "spool")
    stages = [{"stage_id": "gen", "type": "llm", "status": "ok", "step": STEP},
              {"stage_id": "shadow", "type": "shadow", "status": "ok"}]
    record_id = store.write(make_record(2, stages=stages))
    report = store.verify()
    assert report.ok and report.checked == 3
    assert [s["step"] for s in store.get(record_id)["stages"]] == [STEP, None]
    downgrade(bare_engine, "0012")  # the column and the step data go; every stage row stays
    with bare_engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM audit_stages")) == 6
    upgrade(bare_engine)
    assert [step for _, step in _steps(bare_engine)] == [None] * 6
