"""The app factory checks and builds; only the lifespan opens (59.1): no database file, no thread, no socket until
the app starts. A pipeline file that does not load still stops ``inferline serve`` before it listens."""

from __future__ import annotations

import threading

from litestar.testing import TestClient

from serving.cli.main import main
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import write_workspace


def test_the_factory_opens_nothing_until_the_lifespan_runs(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    threads = set(threading.enumerate())
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))
    assert not (tmp_path / "keys.db").exists()  # the database is the lifespan's
    assert set(threading.enumerate()) == threads  # no watcher, no sink writer, no executor
    assert not app.state.inferline.ready
    with TestClient(app) as client:
        assert (tmp_path / "keys.db").exists()
        assert client.post("/pipelines/chat", json={"input": "Capital?"}).json()["output"] == "Paris."
    assert not app.state.inferline.ready  # stopped: new requests get 503


def test_a_pipeline_that_does_not_load_stops_serve_with_its_place(tmp_path, monkeypatch, capsys):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    (tmp_path / "pipelines" / "broken.yaml").write_text("name: broken\nstages:\n  - {id: a, type: nosuch}\n")
    assert main(["serve", "--config", str(config), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "broken.yaml:3:" in err and "nosuch" in err
    assert not (tmp_path / "keys.db").exists()  # refused before anything opened
