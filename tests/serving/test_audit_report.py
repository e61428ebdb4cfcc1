"""``inferline audit report`` and the console's report page over a real log: the figures add up, the
HTML is one self-contained file, the verification says what the digests show."""

from __future__ import annotations

import json

import pytest
from litestar.testing import TestClient

from serving.cli.main import main
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.audit import Anchors, AuditStore, Ed25519Signer, generate_pem
from store.engine import make_engine
from store.keys import KeyStore
from store.migrate import create_schema
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.console.signin import sign_in
from tests.serving.workspaces import write_workspace
from tests.store.audit.test_anchors import cut_tail
from tests.store.audit.test_store import make_record

BLOCK = [{"rule": "injection", "category": "injection", "action": "block", "score": 0.97, "where": "input"}]


def logged_workspace(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=True)
    engine = make_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    create_schema(engine)
    private, public = generate_pem()
    (tmp_path / "signing.pem").write_bytes(private)
    (tmp_path / "signing.pem.pub").write_bytes(public)
    signer = Ed25519Signer.from_pem(private)
    store = AuditStore(engine, spool_path=tmp_path / "spool", checkpoint_key=signer, checkpoint_every=4)
    for i in range(12):
        store.write(make_record(i, policy=BLOCK if i % 6 == 0 else [], status="denied" if i % 6 == 0 else
                                "failed" if i == 5 else "ok", error_type="backend_error" if i == 5 else None))
    Anchors(engine, tmp_path / "digests", signer).deliver()
    return config, engine


def test_the_report_as_json_and_as_one_html_file(tmp_path, monkeypatch, capsys):
    config, engine = logged_workspace(tmp_path, monkeypatch)
    common = ["audit", "report", "--config", str(config), "--public-key", str(tmp_path / "signing.pem.pub"),
              "--anchors", str(tmp_path / "digests")]
    assert main([*common, "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["totals"]["count"] == 12 and report["totals"]["denied"] == 2 and report["totals"]["failed"] == 1
    assert sum(row["count"] for row in report["by_pipeline_version_model"]) == 12
    assert {row["pipeline"] for row in report["cost_by_pipeline"]} == {"support", "rag"}
    assert report["policy_blocks"] == [{"rule": "injection", "category": "injection", "where": "input", "count": 2}]
    assert report["errors"] == [{"error_type": "backend_error", "count": 1}]
    assert report["verification"]["chain"]["ok"] and report["verification"]["chain"]["unchecked_checkpoints"] == 0
    assert report["verification"]["anchors"]["ok"] and report["verification"]["anchors"]["digests"] == 3
    assert {"action": "report", "role": "cli", "key_id": None, "count": 1} in report["access_log"]

    out = tmp_path / "report.html"
    assert main([*common, "--output", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and 'id="chart-requests-by-day"' in page
    assert "Chain intact over the period: 12 record(s)" in page and "matches its 3 digest(s)" in page
    assert "http://" not in page and "https://" not in page and "src=" not in page  # nothing fetched

    cut_tail(engine, 9)
    assert main([*common, "--format", "json"]) == 0
    anchors = json.loads(capsys.readouterr().out)["verification"]["anchors"]
    assert not anchors["ok"] and anchors["findings"][0]["kind"] == "tail_cut"
    assert anchors["database_alone_shows_it"] is False
    with pytest.raises(SystemExit) as exited:  # a bad time: a usage error
        main([*common, "--since", "soon"])
    assert exited.value.code == 2


def test_the_console_report_page(tmp_path, monkeypatch):
    config, engine = logged_workspace(tmp_path, monkeypatch)
    auditor = KeyStore(engine).create("review", "auditor")[1]
    caller = KeyStore(engine).create("app", "caller")[1]
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))
    with TestClient(app) as client:
        sign_in(client, auditor)
        page = client.get("/ui/audit/report", params={"since": "2025-12-01"})
        assert page.status_code == 200 and 'id="report-chain"' in page.text and "12 request(s)" in page.text
        assert 'id="report-blocks"' in page.text and "injection" in page.text
        download = client.get("/ui/audit/report", params={"since": "2025-12-01", "format": "json"})
        assert download.json()["totals"]["count"] == 12
        assert client.get("/ui/audit/report", params={"format": "pdf"}).status_code == 400
        assert client.get("/ui/audit/report", params={"since": "soon"}).status_code == 400
        sign_in(client, caller)  # last: the refusal is a record of its own (docs/audit.md#refused-calls)
        assert client.get("/ui/audit/report").status_code == 403
