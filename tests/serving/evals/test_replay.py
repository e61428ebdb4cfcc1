"""``inferline replay``: audited requests through a candidate, old answers against new (fake engines)."""

from __future__ import annotations

import json

from litestar.testing import TestClient

from serving.cli.replay import read_records
from serving.evals.replay import html_report, replay, summarize_replay
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.audit_filters import AuditFilters
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import CHAT, write_workspace


def audited_workspace(tmp_path, monkeypatch):
    """Three requests served and audited in full, and one by a pipeline that keeps only hashes."""
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    (tmp_path / "pipelines" / "hashed.yaml").write_text(
        CHAT.replace("name: chat", "name: hashed").replace("content: full", "content: hash"))
    workspace = open_workspace(str(config))
    with TestClient(create_server(workspace, engines=FakeEngines(smol=FakeEngine("Paris.")))) as client:
        for question in ("one?", "two?", "three?"):
            assert client.post("/pipelines/chat", json={"input": question}).status_code == 200
        assert client.post("/pipelines/hashed", json={"input": "four?"}).status_code == 200
    return workspace


async def test_an_unchanged_candidate_answers_the_same(tmp_path, monkeypatch):
    workspace = audited_workspace(tmp_path, monkeypatch)
    records, skipped = read_records(workspace.database_url, AuditFilters(pipeline="chat"), 100)
    assert len(records) == 3 and not skipped
    candidate = workspace.load_pipeline(workspace.pipelines_dir / "chat.yaml")
    results = await replay(workspace, candidate, records, engines=FakeEngines(smol=FakeEngine("Paris.")))
    totals = summarize_replay(results, skipped)
    assert totals["replayed"] == 3 and totals["identical"] == 3 and totals["status_changed"] == 0
    assert {r["old"]["output"] for r in results} == {"Paris."}


async def test_a_changed_candidate_shows_the_differences_and_skips_what_was_not_kept(tmp_path, monkeypatch):
    workspace = audited_workspace(tmp_path, monkeypatch)
    records, skipped = read_records(workspace.database_url, AuditFilters(), 100)
    assert len(records) == 3 and skipped == {"content kept as hash": 1}
    candidate_file = tmp_path / "candidate.yaml"
    candidate_file.write_text(CHAT.replace("max_tokens: 64", "max_tokens: 3"))
    candidate = workspace.load_pipeline(candidate_file)
    results = await replay(workspace, candidate, records, engines=FakeEngines(smol=FakeEngine("Paris.")))
    totals = summarize_replay(results, skipped)
    assert totals["identical"] == 0 and totals["skipped"] == 1
    assert all(r["new"]["output"] == "Par" and r["new"]["finish_reason"] == "length" for r in results)
    assert totals["output_tokens"]["new"] < totals["output_tokens"]["old"]
    page = html_report("chat", "candidate.yaml", totals, results)
    assert page.count('<tr class="diff">') == 3 and "http" not in page.split("<body>")[1]


def test_the_command_line_reports_and_exits_1_on_a_change(tmp_path, monkeypatch, capsys):
    from serving.cli.main import main
    from serving.evals import replay as replay_module

    workspace = audited_workspace(tmp_path, monkeypatch)

    async def over_fakes(*args, **kwargs):  # the command over the fake model instead of the config's
        return await replay(*args, **kwargs, engines=FakeEngines(smol=FakeEngine("Paris.")))

    monkeypatch.setattr(replay_module, "replay", over_fakes)  # the command imports it when it runs
    config = str(workspace.root / "inferline.yaml")
    same = main(["replay", "chat", "--candidate", str(workspace.pipelines_dir / "chat.yaml"), "--format", "jsonl",
                 "--config", config])
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert same == 0 and len(lines) == 3 and all(line["identical"] for line in lines)
    assert "replayed 3: 3 identical" in err
    changed = tmp_path / "candidate.yaml"
    changed.write_text(CHAT.replace("max_tokens: 64", "max_tokens: 3"))
    report = tmp_path / "replay.html"
    assert main(["replay", "chat", "--candidate", str(changed), "--html", str(report), "--config", config,
                 "--since", "1h"]) == 1
    assert "0 identical" in capsys.readouterr().err and report.read_text().count('class="diff"') == 3
    assert main(["replay", "hashed", "--candidate", str(changed), "--config", config]) == 0  # nothing replayable
    assert "skipped 1 record(s)" in capsys.readouterr().err
    assert main(["replay", "chat", "--candidate", str(tmp_path / "nope.yaml"), "--config", config]) == 1
    assert main(["replay", "chat", "--candidate", str(changed), "--since", "soon", "--config", config]) == 2


def test_replay_against_a_running_server(tmp_path, monkeypatch, capsys):
    """The records from the server's audit API, the candidate kept there and each input sent to it pinned:
    an unchanged candidate answers the same, a changed one differs; what was not kept is skipped."""
    from serving.cli.main import main
    from store.db import make_engine
    from store.keys import KeyStore
    from store.migrate import create_schema
    from tests.serving.live_server import LiveServer

    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=True)
    (tmp_path / "pipelines" / "hashed.yaml").write_text(
        CHAT.replace("name: chat", "name: hashed").replace("content: full", "content: hash"))
    workspace = open_workspace(str(config))
    engine = make_engine(workspace.database_url)
    create_schema(engine)
    (_, admin), (_, caller) = KeyStore(engine).create("ops", "admin"), KeyStore(engine).create("app", "caller")
    server = LiveServer(create_server(workspace, engines=FakeEngines(smol=FakeEngine("Paris."))))
    try:
        import httpx
        for question in ("one?", "two?"):
            assert httpx.post(f"{server.url}/pipelines/chat", json={"input": question}, timeout=30,
                              headers={"Authorization": f"Bearer {caller}"}).status_code == 200
        common = ["--url", server.url, "--key", admin, "--format", "jsonl"]
        same = main(["replay", "chat", "--candidate", str(workspace.pipelines_dir / "chat.yaml"), *common])
        out, err = capsys.readouterr()
        lines = [json.loads(line) for line in out.splitlines()]
        assert same == 0 and len(lines) == 2 and all(line["identical"] for line in lines), err
        assert {line["new"]["version"] for line in lines} == {"1"} and lines[0]["new"]["status"] == "ok"
        changed = tmp_path / "candidate.yaml"
        changed.write_text(CHAT.replace("max_tokens: 64", "max_tokens: 3").replace("name: chat",
                                                                                   "name: chat\nversion: '2'"))
        assert main(["replay", "chat", "--candidate", str(changed), *common]) == 1
        out, err = capsys.readouterr()
        lines = [json.loads(line) for line in out.splitlines()]
        assert {(line["new"]["version"], line["new"]["output"]) for line in lines} == {("2", "Par")}
        # The first run's requests were served, so audited, too: four records now, none the same.
        assert "replayed 4: 0 identical" in err and "2 not a request" in err  # the keep actions
        assert main(["replay", "chat", "--candidate", "2", "--since", "1h", *common]) == 1  # a kept version
        assert main(["replay", "hashed", "--candidate", "2", *common]) == 0
        assert "skipped" in capsys.readouterr().err
        assert main(["replay", "chat", "--candidate", "7", *common]) == 1  # no such version there
        assert "404" in capsys.readouterr().err
        assert main(["replay", "chat", "--candidate", "2", "--url", server.url, "--key", caller]) == 1
        assert "403" in capsys.readouterr().err  # a caller may not read the audit log
        serving = httpx.post(f"{server.url}/pipelines/chat", json={"input": "x"}, timeout=30,
                             headers={"Authorization": f"Bearer {caller}"}).json()["pipeline_version"]
        assert serving == "1"  # keeping the candidate served nothing new
    finally:
        server.stop()
