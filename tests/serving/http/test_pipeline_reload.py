"""Hot reload through the app: the watcher picks up a new file, a bad edit and a deletion, and the
pipeline routes show what it found (fake engines; a real server process: tests/serving/cli/test_serve.py)."""

from __future__ import annotations

import time

from litestar.testing import TestClient

from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import CHAT, write_workspace


def eventually(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.05)


def test_the_served_pipelines_follow_the_folder(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    config.write_text(config.read_text() + "reload: {poll_s: 0.1}\n")
    folder = tmp_path / "pipelines"
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))
    with TestClient(app) as client:
        assert client.get("/pipelines/second").status_code == 404
        (folder / "second.yaml").write_text(CHAT.replace("name: chat", "name: second"))
        assert eventually(lambda: client.get("/pipelines/second").status_code == 200)
        answer = client.post("/pipelines/second", json={"input": "Capital?"})
        assert answer.status_code == 200 and answer.json()["output"] == "Paris."
        assert answer.headers["x-pipeline-version"] == "1"
        assert answer.json()["spec_sha256"] == answer.headers["x-pipeline-spec-sha256"]

        (folder / "chat.yaml").write_text(CHAT.replace("max_tokens: 64", "max_tokens: many"))
        described = eventually(lambda: client.get("/pipelines/chat").json().get("reload_error"))
        assert described["file"].endswith("chat.yaml")
        assert described["issues"][0]["line"] == 8 and "max_tokens" in described["issues"][0]["loc"]
        assert client.post("/pipelines/chat", json={"input": "Capital?"}).status_code == 200  # still served
        assert client.get("/pipelines").json()["reload_errors"][0]["pipeline"] == "chat"
        for page in ("/ui/pipelines", "/ui/pipelines/chat"):  # the console shows it too
            html = client.get(page).text
            assert "keeps serving its running version" in html and "chat.yaml:8:" in html
        metrics = client.get("/metrics").text
        assert 'inferline_pipeline_reloads_total{result="invalid"} 1.0' in metrics

        (folder / "second.yaml").unlink()
        assert eventually(lambda: client.get("/pipelines/second").status_code == 404)
        assert client.post("/pipelines/second", json={"input": "Capital?"}).status_code == 404


def test_each_record_leads_to_the_exact_yaml_that_served_it(tmp_path, monkeypatch, capsys):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    config.write_text(config.read_text() + "reload: {poll_s: 0.1}\n")
    chat = tmp_path / "pipelines" / "chat.yaml"
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))
    with TestClient(app) as client:
        first = client.post("/pipelines/chat", json={"input": "one"}).json()
        edited = CHAT.replace("name: chat", "name: chat\nversion: '2'")
        chat.write_text(edited)
        assert eventually(lambda: client.get("/pipelines/chat").json()["version"] == "2")
        second = client.post("/pipelines/chat", json={"input": "two"}).json()
        records = {r["request_id"]: r for r in client.get("/audit/records").json()["records"]}
        old = client.get(f"/audit/records/{records[first['request_id']]['id']}/spec").json()
        new = client.get(f"/audit/records/{records[second['request_id']]['id']}/spec").json()
        assert (old["version"], old["text"]) == ("1", CHAT) and old["spec_sha256"] == first["spec_sha256"]
        assert (new["version"], new["text"]) == ("2", edited) and new["deployed_by"] == "file"
        page = client.get(f"/ui/audit/records/{records[second['request_id']]['id']}/spec")
        assert page.status_code == 200 and "version: &#39;2&#39;" in page.text
        assert client.get("/audit/records/nope/spec").status_code == 404
        record_id = records[first["request_id"]]["id"]
    from serving.cli.main import main

    assert main(["audit", "show", record_id, "--spec", "--config", str(config)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# chat version 1, sha256 ") and printed.endswith(CHAT)  # CHAT ends with a newline
