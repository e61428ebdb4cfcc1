"""Two servers on one PostgreSQL database and one pipelines folder (each app with its own runtime and
watcher, served by uvicorn): a deploy (a chain, and the triage workflow), a rollback, a canary split or a
shadow through either reaches the other within seconds. Each looks at its folder only every 60 s here: what
reaches the other is the database's notice (LISTEN/NOTIFY)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngines
from tests.pipeline.test_workflow import ScriptedEngine
from tests.postgres import fresh_schema_url
from tests.serving.live_server import LiveServer
from tests.serving.workspaces import CHAT, write_workspace

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[3]


def served_version(server: LiveServer) -> str:
    return httpx.post(f"{server.url}/pipelines/chat", json={"input": "Capital?"}, timeout=30).json()["pipeline_version"]


def within(seconds: float, check) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < seconds, f"not within {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_deploy_and_a_rollback_reach_every_server(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    shared = write_workspace(tmp_path, auth=False).parent / "pipelines"
    servers = []
    with fresh_schema_url() as url:
        try:
            for n in range(2):
                root = tmp_path / f"server{n}"
                root.mkdir()
                text = (tmp_path / "inferline.yaml").read_text()
                text = text.replace("pipelines: pipelines/", f"pipelines: {shared}/")
                text = text.replace(f"database: sqlite:///{tmp_path / 'keys.db'}", f"database: '{url}'")
                (root / "inferline.yaml").write_text(text + "reload: {poll_s: 60}\n")
                engine = ScriptedEngine({"Sort the customer": '{"intent": "tech", "urgency": 2, "amount": 0}',
                                         "technical support": "Restart the app."})
                app = create_server(open_workspace(str(root / "inferline.yaml")), engines=FakeEngines(smol=engine))
                servers.append(LiveServer(app))
            a, b = servers
            deployed = httpx.post(f"{a.url}/pipelines/chat/versions", timeout=30,
                                  json={"yaml": CHAT.replace("name: chat", "name: chat\nversion: '2'")})
            assert deployed.status_code == 201 and served_version(a) == "2"
            assert within(5, lambda: served_version(b) == "2") < 5
            kept = httpx.get(f"{b.url}/pipelines/chat/versions").json()["versions"]  # one table for both
            assert [(v["version"], v["active"]) for v in kept] == [("2", True), ("1", False)]
            assert httpx.post(f"{b.url}/pipelines/chat/rollback", timeout=30).status_code == 200
            assert served_version(b) == "1"
            assert within(5, lambda: served_version(a) == "1") < 5

            def b_sees() -> dict:
                return httpx.get(f"{b.url}/pipelines/chat/versions", timeout=30).json()

            assert httpx.put(f"{a.url}/pipelines/chat/traffic", json={"weights": {"1": 90, "2": 10}},
                             timeout=30).status_code == 200
            assert within(5, lambda: sorted((b_sees()["traffic"] or {}).values()) == [10, 90]) < 5
            assert httpx.put(f"{a.url}/pipelines/chat/shadow", json={"version": "2", "percent": 20},
                             timeout=30).status_code == 200
            assert within(5, lambda: (b_sees()["shadow"] or {}).get("percent") == 20) < 5

            # A workflow (the triage example) deployed through one serves on the other, and its record, with
            # each step, is in the one log both write.
            triage = (ROOT / "pipelines" / "triage.yaml").read_text()
            assert httpx.post(f"{b.url}/pipelines/triage/versions", json={"yaml": triage},
                              timeout=30).status_code == 201

            def triaged() -> httpx.Response:
                return httpx.post(f"{a.url}/pipelines/triage", json={"input": "The app crashes."}, timeout=30)

            assert within(5, lambda: triaged().status_code == 200) < 5
            answer = triaged().json()
            assert answer["output"] == "Restart the app."
            statuses = {stage["id"]: stage["status"] for stage in answer["stages"]}
            assert (statuses["classify"], statuses["tech"], statuses["refund"], statuses["other"]) == \
                ("ok", "ok", "skipped", "skipped")

            def kept() -> list[dict]:  # a's records reach the database as its writer flushes them
                return httpx.get(f"{b.url}/audit/records", params={"pipeline": "triage"}, timeout=30).json()["records"]

            within(10, lambda: any(r["request_id"] == answer["request_id"] for r in kept()))
            found = next(r for r in kept() if r["request_id"] == answer["request_id"])
            record = httpx.get(f"{b.url}/audit/records/{found['id']}", timeout=30).json()
            steps = {stage["stage_id"]: stage["step"] for stage in record["stages"]}
            assert steps["classify"]["output"]["output"] == {"intent": "tech", "urgency": 2, "amount": 0}
        finally:
            for server in servers:
                server.stop()
