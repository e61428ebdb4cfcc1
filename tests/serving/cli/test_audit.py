"""inferline audit ...: queries, verify with its exit code, export, hold and prune."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from serving.cli.main import main
from serving.runtime.workspace import open_workspace
from store.audit import AuditStore, parse_filters
from store.audit.query import EXPORT_COLUMNS
from store.engine import make_engine
from store.keys import KeyStore
from store.migrate import create_schema
from tests.serving.workspaces import write_workspace


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


# --- the API's filters, formats, --database, key names, the access log (issue 44) ---------------------

@pytest.mark.parametrize("action", ["query", "summary", "export", "verify"])
def test_naive_and_relative_dates_are_utc(config, capsys, action):
    def run(*options: str) -> str:
        machine = ["--format", "jsonl"] if action in ("query", "summary") else []
        assert main(["audit", action, "--config", config, *machine, *options]) == 0, options
        return capsys.readouterr().out
    everything, recent = run("--since", "2000-01-01"), run("--since", "30d")  # 2 records are 400 days old
    assert everything != recent
    assert run("--since", "2000-01-01T00:00") == everything and run("--since", "yesterday") == recent
    if action == "query":
        assert len(everything.splitlines()) == 4 and len(recent.splitlines()) == 2
    elif action == "verify":
        assert "ok: 4 record(s) checked" in everything and "ok: 2 record(s) checked" in recent


def test_bad_times_and_costs_are_usage_errors(config, capsys):
    for options in (["--since", "someday"], ["--until", "7 days"], ["--min-cost-usd", "nan"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["audit", "query", "--config", config, *options])
        assert exit_info.value.code == 2
        assert repr(options[1]) in capsys.readouterr().err


def test_summary_takes_the_filters(config, capsys):
    engine = make_engine(open_workspace(config).database_url)
    AuditStore(engine, spool_path=Path(config).parent / "spool.jsonl").write({"pipeline": "other"})
    engine.dispose()
    assert main(["audit", "summary", "--config", config, "--format", "jsonl"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert main(["audit", "summary", "--config", config, "--pipeline", "other", "--format", "jsonl"]) == 0
    (group,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert group == {**group, "pipeline": "other", "count": 1}
    assert main(["audit", "summary", "--config", config, "--status", "failed", "--format", "jsonl"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 1


def test_database_option_and_environment(config, tmp_path, capsys, monkeypatch):
    seeded_url = open_workspace(config).database_url
    (tmp_path / "other").mkdir()
    empty = write_workspace(tmp_path / "other", auth=False)  # its own, empty database
    assert main(["audit", "query", "--config", str(empty), "--format", "jsonl"]) == 0
    assert capsys.readouterr().out == ""
    assert main(["audit", "query", "--config", str(empty), "--database", seeded_url, "--format", "jsonl"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4
    monkeypatch.setenv("INFERLINE_DATABASE", seeded_url)
    assert main(["audit", "verify", "--config", str(empty)]) == 0
    assert "4 record(s) checked" in capsys.readouterr().out


def test_formats_key_names_and_no_match(config, capsys):
    engine = make_engine(open_workspace(config).database_url)
    info, _ = KeyStore(engine).create("support bot", "caller")
    AuditStore(engine, spool_path=Path(config).parent / "spool.jsonl").write(
        {"pipeline": "chat", "key_id": info.id, "model": "smol", "request_id": "keyed"})
    engine.dispose()
    base = ["audit", "query", "--config", config, "--key-id", info.id]
    assert main([*base, "--format", "jsonl"]) == 0
    assert json.loads(capsys.readouterr().out)["key_name"] == "support bot"
    assert main([*base, "--format", "table"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["received", "(UTC)", "pipeline", "status"]
    assert f"{info.id} (support bot)" in row and "smol" in row
    assert main([*base, "--format", "csv"]) == 0
    (parsed,) = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert parsed["key_name"] == "support bot" and parsed["request_id"] == "keyed"
    assert main(["audit", "summary", "--config", config, "--group-by", "key_id", "--format", "table"]) == 0
    assert f"{info.id} (support bot)" in capsys.readouterr().out
    for action, fmt in (("query", "jsonl"), ("summary", "csv"), ("export", "csv")):
        assert main(["audit", action, "--config", config, "--pipeline", "nope", "--format", fmt]) == 0
        out, err = capsys.readouterr()
        assert err.strip() == "no records match" and out in ("", ",".join([*EXPORT_COLUMNS, "stages"]) + "\n")
    assert main(["audit", "query", "--config", config, "--pipeline", "nope", "--format", "table"]) == 0
    assert capsys.readouterr().out.strip() == "no records match"


def test_table_is_the_default_on_a_terminal(config, capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["audit", "query", "--config", config]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("received (UTC)") and len(lines) == 5


def test_the_access_log_on_the_cli(config, capsys):
    engine = make_engine(open_workspace(config).database_url)
    info, _ = KeyStore(engine).create("reviewer", "auditor")
    store = AuditStore(engine, spool_path=Path(config).parent / "spool.jsonl")
    store.log_access(info.id, "auditor", "query", {"pipeline": "chat"})
    store.log_access(info.id, "auditor", "export", {"format": "csv"})
    store.log_access(None, None, "verify", {})
    engine.dispose()
    assert main(["audit", "access", "--config", config, "--format", "jsonl"]) == 0
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["action"] for e in entries] == ["access", "verify", "export", "query"]  # this read is logged too
    assert entries[2]["key_name"] == "reviewer" and entries[2]["query"] == {"format": "csv"}
    assert main(["audit", "access", "--config", config, "--key-id", info.id, "--action", "query",
                 "--since", "1h", "--format", "table"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["at", "(UTC)", "key"] and f"{info.id} (reviewer)" in row and '"chat"' in row
    assert main(["audit", "access", "--config", config, "--limit", "1", "--format", "jsonl"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and "more: --cursor" in err
    assert main(["audit", "access", "--config", config, "--action", "prune", "--format", "jsonl"]) == 0
    assert capsys.readouterr().err.strip() == "no access-log entries match"


def test_every_read_on_the_cli_is_in_the_access_log(config, capsys):
    record_id = AuditStore(make_engine(open_workspace(config).database_url), spool_path=Path(config).parent / "s") \
        .query(parse_filters({}), limit=1).records[0]["id"]
    for argv in (["query", "--pipeline", "chat", "--since", "2026-01-01", "--limit", "2"], ["show", record_id],
                 ["show", record_id, "--spec"], ["summary", "--group-by", "model"], ["export", "--format", "csv"],
                 ["verify", "--until", "2099-01-01"], ["access", "--action", "query"]):
        main(["audit", *argv, "--config", config])
    capsys.readouterr()
    engine = make_engine(open_workspace(config).database_url)
    entries = AuditStore(engine, spool_path=Path(config).parent / "s").access_log(10)
    assert [(e["action"], e["role"], e["key_id"]) for e in reversed(entries)] == [
        (action, "cli", None) for action in ("query", "show", "show spec", "summary", "export", "verify", "access")]
    logged = {e["action"]: e["query"] for e in entries}
    assert logged["query"] == {"pipeline": "chat", "since": "2026-01-01T00:00:00+00:00", "sort": "-received_at",
                               "limit": 2}
    assert logged["show"] == {"record_id": record_id} and logged["summary"] == {"group_by": "model"}
    assert logged["export"] == {"format": "csv"} and logged["verify"] == {"until": "2099-01-01T00:00:00+00:00"}
    assert logged["access"] == {"action": "query", "limit": 50}


def test_an_export_into_a_pipe_closed_early_ends_quietly(config, tmp_path):
    engine = make_engine(open_workspace(config).database_url)
    AuditStore(engine, spool_path=tmp_path / "spool").write_batch(
        [{"pipeline": "chat", "input_content": f"question {i} " + "x" * 500} for i in range(400)])
    engine.dispose()
    # More than a pipe holds (64 KiB): the export is still writing when the reader goes, as with `| head -1`.
    with subprocess.Popen([sys.executable, "-m", "serving.cli", "audit", "export", "--config", config],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parents[3]) as export:
        assert export.stdout is not None
        assert json.loads(export.stdout.readline())["pipeline"] == "chat"
        export.stdout.close()
        err = export.communicate(timeout=60)[1].decode()
    assert export.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
