"""inferline audit ...: queries, verify with its exit code, export, hold and prune."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from serving.cli import main
from serving.wiring import open_workspace
from store.audit import AuditStore
from store.db import create_schema, make_engine
from tests.serving.conftest import write_workspace


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.delenv("INFERLINE_CONFIG", raising=False)
    path = write_workspace(tmp_path, auth=False)
    engine = make_engine(open_workspace(str(path)).database_url)
    create_schema(engine)
    store = AuditStore(engine, spool_path=tmp_path / "spool.jsonl")
    old = datetime.now(UTC) - timedelta(days=400)
    for index in range(4):
        store.write({"pipeline": "chat", "status": "ok" if index else "failed", "request_id": f"r{index}",
                     "received_at": old if index < 2 else datetime.now(UTC), "input_content": f"question {index}"})
    engine.dispose()
    return str(path)


def test_query_show_summary_export(config, capsys):
    assert main(["audit", "query", "--config", config, "--status", "failed"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    record = json.loads(line)
    assert record["request_id"] == "r0"
    assert main(["audit", "show", record["id"], "--config", config]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == record["id"]
    assert main(["audit", "summary", "--config", config]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 4
    assert main(["audit", "export", "--format", "csv", "--config", config]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 5  # header + 4 rows
    assert main(["audit", "query", "--config", config, "--sort", "nonsense"]) == 1


def test_verify_exit_codes(config, capsys):
    assert main(["audit", "verify", "--config", config]) == 0
    assert capsys.readouterr().out.startswith("ok: 4 record(s) checked")
    engine = make_engine(open_workspace(config).database_url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE audit_records SET cost_usd = 99 WHERE request_id = 'r2'"))
    engine.dispose()
    assert main(["audit", "verify", "--config", config]) == 1
    assert "modified: seq 3" in capsys.readouterr().out
    assert main(["audit", "verify", "--config", config, "--workers", "2"]) == 1  # seqs 1-2 and 3-4 in two processes
    assert "modified: seq 3" in capsys.readouterr().out


def test_verify_refuses_workers_below_one(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", "verify", "--config", config, "--workers", "0"])
    assert exit_info.value.code == 2
    assert "at least 1, got '0'" in capsys.readouterr().err


def test_hold_then_prune_keeps_the_chain_valid(config, capsys):
    assert main(["audit", "hold", "--record", _id(config, "r1"), "--config", config]) == 0
    assert main(["audit", "prune", "--config", config]) == 0  # chat keeps 365 days (the audit stage's default)
    assert "pruned 1 record(s)" in capsys.readouterr().out  # r0 is past retention; r1 is on hold
    assert main(["audit", "verify", "--config", config]) == 0


def _id(config: str, request_id: str) -> str:
    engine = make_engine(open_workspace(config).database_url)
    with engine.connect() as conn:
        found = conn.execute(sa.text("SELECT id FROM audit_records WHERE request_id = :r"), {"r": request_id})
        value = found.scalar_one()
    engine.dispose()
    return value
