"""Deploy, activate, roll back and retire through the API: the folder follows, the served version
switches at once, a bad version changes nothing, and every action is an audit record of its own."""

from __future__ import annotations

import time
import uuid

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
        assert pinned.json()["pipeline_version"] == "1" and pinned.json()["system_fingerprint"] == first
        assert pinned.json()["answered_by"] == {"model": "smol", "fallbacks_tried": []}
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
        deployments = app.state.inferline.services.deployments
        chosen = [deployments.split_choice("chat", f"key-{n}") for n in range(2000)]
        canary = next(sha for sha, weight in split.json()["weights"].items() if weight == 5)
        assert abs(chosen.count(canary) / 2000 - 0.05) <= 0.03  # within 3 points of its weight
        assert len({deployments.split_choice("chat", "key-7") for _ in range(3)}) == 1
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


def _metric(client: TestClient, line_start: str) -> float:
    found = [line for line in client.get("/metrics").text.splitlines() if line.startswith(line_start)]
    return float(found[0].rsplit(" ", 1)[1]) if found else 0.0


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_shadow_runs_never_change_the_answer_and_record_both_sides(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    engines = FakeEngines(smol=FakeEngine("Paris."))
    app = create_server(open_workspace(str(config)), engines=engines)
    short = v("2").replace("max_tokens: 64", "max_tokens: 3")  # the candidate answers "Par"
    with TestClient(app) as client:
        kept = client.post("/pipelines/chat/versions", json={"yaml": short, "activate": False})
        assert kept.status_code == 201 and kept.json()["active"] is False and kept.json()["version"] == "2"
        assert "max_tokens: 64" in (tmp_path / "pipelines" / "chat.yaml").read_text()  # nothing written
        assert client.put("/pipelines/chat/shadow", json={"version": "9", "percent": 5}).status_code == 404
        assert client.put("/pipelines/chat/shadow", json={"version": "2", "percent": 0}).status_code == 422
        assert client.put("/pipelines/chat/shadow", json={"version": "2", "percent": 101}).status_code == 422
        shadow = client.put("/pipelines/chat/shadow", json={"version": "2", "percent": 100})
        assert shadow.status_code == 200 and shadow.json()["shadow"]["percent"] == 100
        assert client.get("/pipelines/chat/versions").json()["shadow"]["spec_sha256"] == kept.json()["spec_sha256"]

        answers = [client.post("/pipelines/chat", json={"input": f"Capital {n}?"}) for n in range(5)]
        assert {(a.json()["output"], a.json()["pipeline_version"]) for a in answers} == {("Paris.", "1")}
        runs = 'inferline_shadow_runs_total{candidate="2",output="different",pipeline="chat"}'
        _wait_for(lambda: _metric(client, runs) == 5)
        assert _metric(client, 'inferline_shadow_duration_seconds_count{pipeline="chat",side="shadow"}') == 5
        assert _metric(client, 'inferline_shadow_output_tokens_total{pipeline="chat",side="served"}') == 30
        assert _metric(client, 'inferline_shadow_output_tokens_total{pipeline="chat",side="shadow"}') == 15
        assert _metric(client, 'inferline_shadow_policy_total{candidate="2",decision="same",pipeline="chat"}') == 5
        assert _metric(client, 'inferline_pipeline_requests_total{pipeline="chat",status="ok"}') == 5  # served only

        records = client.get("/audit/records", params={"limit": 50, "pipeline": "chat"}).json()["records"]
        records = [r for r in records if r["model"]]  # requests, not the deploy actions
        served = {r["request_id"]: r for r in records if r["pipeline_version"] == "1"}
        shadows = [r for r in records if r["pipeline_version"] == "2"]
        assert len(served) == 5 and len(shadows) == 5 and {r["output_content"] for r in shadows} == {"Par"}
        for record in shadows:
            row = client.get(f"/audit/records/{record['id']}").json()
            decision = next(s["decision"] for s in row["stages"] if s["type"] == "shadow")
            assert decision["of"] in served and decision["output_identical"] is False
            assert decision["served"]["version"] == "1" and decision["served"]["output_tokens"] == 6
        assert {a.json()["request_id"] for a in answers} == set(served)

        assert client.delete("/pipelines/chat/shadow").json()["shadow"] is None
        client.post("/pipelines/chat", json={"input": "Capital?"})
        time.sleep(0.2)
        assert _metric(client, runs) == 5  # no more shadow runs
        rules = [p["message"] for r in client.get("/audit/records", params={"limit": 100}).json()["records"]
                 for p in r.get("policy") or [] if p.get("where") == "deploy"]
        assert any(m.startswith("shadow chat: 100% also run on version 2") for m in rules)
        assert "shadow chat: cleared" in rules and any(m.startswith("keep chat: version 2") for m in rules)
        assert client.get("/audit/verify").json()["ok"] is True


def test_a_shadow_picks_its_share_of_requests_and_identical_candidates_compare_so(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))
    with TestClient(app) as client:
        assert client.post("/pipelines/chat/versions", json={"yaml": v("2"), "activate": False}).status_code == 201
        assert client.put("/pipelines/chat/shadow", json={"version": "2", "percent": 30}).status_code == 200
        deployments = app.state.inferline.services.deployments
        picked = [deployments.shadow_choice("chat", uuid.uuid4().hex) for _ in range(2000)]
        assert abs(sum(p is not None for p in picked) / 2000 - 0.30) <= 0.03
        assert deployments.shadow_choice("chat", "r-1") == deployments.shadow_choice("chat", "r-1")
        assert client.put("/pipelines/chat/shadow", json={"version": "2", "percent": 100}).status_code == 200
        client.post("/pipelines/chat", json={"input": "Capital?"})
        _wait_for(lambda: _metric(
            client, 'inferline_shadow_runs_total{candidate="2",output="identical",pipeline="chat"}') == 1)
        # A shadow uses up no caller's limit: two requests a minute are two, with their two shadows.
        limited = v("3").replace("stages:\n", "stages:\n  - {id: guard, type: policy, with: {limits: "
                                 "{requests_per_minute: 2, per: pipeline}}}\n")
        assert client.post("/pipelines/chat/versions", json={"yaml": limited}).status_code == 201
        candidate = limited.replace("version: '3'", "version: '4'")
        assert client.post("/pipelines/chat/versions", json={"yaml": candidate, "activate": False}).status_code == 201
        assert client.put("/pipelines/chat/shadow", json={"version": "4", "percent": 100}).status_code == 200
        mirrored = 'inferline_shadow_runs_total{candidate="4",output="identical",pipeline="chat"}'
        for n in (1, 2):
            assert client.post("/pipelines/chat", json={"input": "Capital?"}).status_code == 200
            _wait_for(lambda n=n: _metric(client, mirrored) == n)
        assert client.post("/pipelines/chat", json={"input": "Capital?"}).status_code == 429
