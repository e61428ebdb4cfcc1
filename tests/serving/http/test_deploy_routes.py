"""Deploy, activate, roll back and retire through the API: the folder follows, the served version
switches at once, a bad version changes nothing, and every action is an audit record of its own."""

from __future__ import annotations

from litestar.testing import TestClient

from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import CHAT, write_workspace


def v(label: str) -> str:
    return CHAT.replace("name: chat", f"name: chat\nversion: '{label}'")


def test_deploy_activate_rollback_and_retire(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    chat = tmp_path / "pipelines" / "chat.yaml"
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))
    with TestClient(app) as client:
        def served() -> str:
            return client.post("/pipelines/chat", json={"input": "Capital?"}).json()["pipeline_version"]

        deployed = client.post("/pipelines/chat/versions", json={"yaml": v("2")})
        assert deployed.status_code == 201, deployed.text
        assert deployed.json()["version"] == "2" and deployed.json()["active"] is True
        assert served() == "2" and chat.read_text() == v("2")  # the folder is the source of truth
        assert client.post("/pipelines/chat/versions", json={"yaml": v("3")}).status_code == 201

        listed = client.get("/pipelines/chat/versions").json()
        assert [(x["version"], x["active"]) for x in listed["versions"]] == [("3", True), ("2", False), ("1", False)]
        assert listed["versions"][0]["deployed_by"] == "anonymous" and listed["versions"][2]["deployed_by"] == "file"

        rolled = client.post("/pipelines/chat/rollback")
        assert rolled.status_code == 200 and rolled.json()["version"] == "2" and served() == "2"
        first = listed["versions"][2]["spec_sha256"]
        assert client.post("/pipelines/chat/activate", json={"spec_sha256": first[:12]}).json()["version"] == "1"
        assert served() == "1"
        assert client.post("/pipelines/chat/rollback").status_code == 409  # the oldest kept

        bad = client.post("/pipelines/chat/versions", json={"yaml": CHAT.replace("type: tokenize", "type: tokenise")})
        assert bad.status_code == 400 and bad.json()["issues"][0]["line"] == 7 and served() == "1"
        other = client.post("/pipelines/chat/versions", json={"yaml": CHAT.replace("name: chat", "name: other")})
        assert other.status_code == 400 and "not 'chat'" in other.json()["detail"]
        assert client.post("/pipelines/chat/activate", json={"spec_sha256": "ffffff"}).status_code == 404
        assert client.post("/pipelines/chat/versions", json={"yaml": v("4"), "extra": 1}).status_code == 422

        new = client.post("/pipelines/fresh/versions", json={"yaml": CHAT.replace("name: chat", "name: fresh")})
        assert new.status_code == 201 and (tmp_path / "pipelines" / "fresh.yaml").exists()
        assert client.post("/pipelines/fresh", json={"input": "hi"}).status_code == 200
        assert client.delete("/pipelines/fresh").json()["retired"] is True
        assert client.post("/pipelines/fresh", json={"input": "hi"}).status_code == 404
        assert client.delete("/pipelines/fresh").status_code == 404

        actions = [p["message"] for r in client.get("/audit/records", params={"limit": 200}).json()["records"]
                   for p in r.get("policy") or [] if p.get("where") == "deploy"]
        assert [a.split(" ", 1)[0] for a in reversed(actions)] == [
            "deploy", "deploy", "rollback", "activate", "deploy", "retire"]
        assert any(a.startswith("rollback chat: version 3 (") and "-> version 2 (" in a for a in actions)
        assert client.get("/audit/verify").json()["ok"] is True


def test_a_caller_pins_a_kept_version(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))
    with TestClient(app) as client:
        first = client.get("/pipelines/chat").json()["sha256"]
        assert client.post("/pipelines/chat/versions", json={"yaml": v("2")}).status_code == 201
        body = {"messages": [{"role": "user", "content": "Capital?"}]}
        pinned = client.post("/v1/chat/completions", json={"model": "chat@1", **body})
        assert pinned.status_code == 200 and pinned.headers["x-pipeline-version"] == "1"
        assert client.post("/v1/chat/completions", json={"model": "chat", **body}).headers["x-pipeline-version"] == "2"
        by_hash = client.post("/pipelines/chat", json={"input": "Capital?"}, headers={"X-Pipeline-Version": first[:8]})
        assert by_hash.json()["pipeline_version"] == "1" and by_hash.json()["spec_sha256"] == first
        assert client.post("/pipelines/chat@2", json={"input": "Capital?"}).json()["pipeline_version"] == "2"
        missing = client.post("/pipelines/chat", json={"input": "x"}, headers={"X-Pipeline-Version": "9"})
        assert missing.status_code == 404 and "has no version '9'" in missing.json()["detail"]
        assert client.post("/v1/chat/completions", json={"model": "nope@1", **body}).status_code == 404
        records = client.get("/audit/records", params={"limit": 10}).json()["records"]
        assert {r["pipeline_version"] for r in records if r["pipeline"] == "chat"} >= {"1", "2"}


def test_a_canary_split_is_sticky_per_caller_and_promotes(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))
    with TestClient(app) as client:
        assert client.post("/pipelines/chat/versions", json={"yaml": v("2")}).status_code == 201
        assert client.post("/pipelines/chat/activate", json={"spec_sha256": client.get(
            "/pipelines/chat/versions").json()["versions"][1]["spec_sha256"]}).json()["version"] == "1"
        split = client.put("/pipelines/chat/traffic", json={"weights": {"1": 95, "2": 5}})
        assert split.status_code == 200 and sorted(split.json()["weights"].values()) == [5, 95]
        runtime = app.state.inferline.reloader.runtime
        chosen = [runtime.split_choice("chat", f"key-{n}") for n in range(2000)]
        canary = next(sha for sha, weight in split.json()["weights"].items() if weight == 5)
        assert abs(chosen.count(canary) / 2000 - 0.05) <= 0.03  # within 3 points of its weight
        assert [runtime.split_choice("chat", "key-7")] * 3 == [runtime.split_choice("chat", "key-7") for _ in range(3)]
        versions = {client.post("/pipelines/chat", json={"input": "q"}).json()["pipeline_version"] for _ in range(20)}
        assert len(versions) == 1  # one caller, one version
        bad = client.put("/pipelines/chat/traffic", json={"weights": {"7": 100}})
        assert bad.status_code == 400 and bad.json()["versions"] == ["2", "1"]
        assert client.put("/pipelines/chat/traffic", json={"weights": {"1": 0}}).status_code == 400
        promoted = client.post("/pipelines/chat/promote")
        assert promoted.status_code == 200 and promoted.json()["version"] == "2"
        assert client.get("/pipelines/chat/versions").json()["traffic"] is None
        assert client.post("/pipelines/chat", json={"input": "q"}).json()["pipeline_version"] == "2"
        assert client.post("/pipelines/chat/promote").status_code == 409  # no canary left
        assert client.put("/pipelines/chat/traffic", json={"weights": {"1": 50, "2": 50}}).status_code == 200
        assert client.delete("/pipelines/chat/traffic").json()["weights"] is None
        rules = [p["rule"] for r in client.get("/audit/records", params={"limit": 100}).json()["records"]
                 for p in r.get("policy") or [] if p.get("where") == "deploy"]
        assert rules.count("split") == 3 and "promote" in rules
