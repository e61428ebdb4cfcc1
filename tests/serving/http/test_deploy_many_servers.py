"""Two servers on one PostgreSQL database and one pipelines folder (each app with its own runtime and
watcher, served by uvicorn): a deploy, a rollback, a canary split or a shadow through either reaches the
other within seconds. Each looks at its folder only every 60 s here: what reaches the other is the
database's notice (LISTEN/NOTIFY)."""

from __future__ import annotations

import time

import httpx
import pytest

from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.postgres import fresh_schema_url
from tests.serving.live_server import LiveServer
from tests.serving.workspaces import CHAT, write_workspace

pytestmark = pytest.mark.integration


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
                app = create_server(open_workspace(str(root / "inferline.yaml")),
                                    engines=FakeEngines(smol=FakeEngine("Paris.")))
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
        finally:
            for server in servers:
                server.stop()
