"""``create_server`` is the HTTP app with the web console; ``create_app`` alone has no console."""

from __future__ import annotations

from litestar.testing import TestClient

from serving.http.app import create_app
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import write_workspace


def test_the_console_is_added_by_create_server_only(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    workspace = open_workspace(str(write_workspace(tmp_path, auth=False)))
    engines = FakeEngines(smol=FakeEngine("Paris."))
    with TestClient(create_app(workspace, engines=engines)) as client:
        assert client.get("/pipelines").status_code == 200
        assert client.get("/ui/").status_code == 404
    with TestClient(create_server(workspace, engines=engines)) as client:
        assert client.get("/pipelines").status_code == 200
        page = client.get("/ui/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
