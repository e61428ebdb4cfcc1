"""Listening while starting: a real uvicorn server answers its probes while its resources open in the background."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from serving.runtime import resources
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.serving.live_server import LiveServer
from tests.serving.workspaces import write_workspace

pytestmark = pytest.mark.integration


@pytest.fixture
def slow_open(monkeypatch):
    """The runtime's open (database, models, indexes) waits until the test sets the event; a *failure* set
    beside it makes the open raise instead."""
    gate, failure = threading.Event(), []
    opened = resources.Runtime._open

    async def slow(self, stack):
        while not gate.is_set():
            await asyncio.sleep(0.02)
        if failure:
            raise failure[0]
        await opened(self, stack)

    monkeypatch.setattr(resources.Runtime, "_open", slow)
    return gate, failure


def serve(tmp_path, monkeypatch, fake_engines) -> tuple[LiveServer, object]:
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    app = create_server(open_workspace(str(write_workspace(tmp_path, auth=False))), engines=fake_engines,
                        listen_while_starting=True)
    return LiveServer(app), app


def test_the_server_listens_and_answers_503_until_its_models_are_loaded(tmp_path, monkeypatch, fake_engines,
                                                                        slow_open):
    gate, _ = slow_open
    server, app = serve(tmp_path, monkeypatch, fake_engines)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            assert http.get("/healthz").status_code == 200  # liveness: a probe does not restart us
            for path in ("/readyz", "/health"):
                response = http.get(path)
                assert response.status_code == 503 and response.headers["retry-after"], path
            assert http.get("/version").status_code == 200
            call = http.post("/pipelines/chat", json={"input": "hi"})
            assert call.status_code == 503 and call.json()["type"].endswith("starting")
            assert int(call.headers["retry-after"]) > 0
            openai = http.post("/v1/chat/completions", json={"model": "chat", "messages": [{"role": "user",
                                                                                            "content": "hi"}]})
            assert openai.status_code == 503
            assert http.get("/audit/records").status_code == 503
            assert http.get("/schema/openapi.json").status_code == 200
            gate.set()
            for _ in range(200):
                if http.get("/readyz").status_code == 200:
                    break
                threading.Event().wait(0.05)
            assert http.get("/health").status_code == 200
            answer = http.post("/pipelines/chat", json={"input": "Capital of France?"})
            assert answer.status_code == 200 and answer.json()["output"] == "Paris is the capital of France."
    finally:
        server.stop()
    assert not app.state.inferline.start_error


def test_a_failed_start_fails_liveness_and_stops_the_server(tmp_path, monkeypatch, fake_engines, slow_open):
    gate, failure = slow_open
    server, app = serve(tmp_path, monkeypatch, fake_engines)
    stopped = threading.Event()
    app.state.inferline.stop_serving = stopped.set
    try:
        failure.append(OSError("models/missing: no such file"))
        gate.set()
        assert stopped.wait(10)
        with httpx.Client(base_url=server.url, timeout=10) as http:
            assert http.get("/healthz").status_code == 503
            assert http.get("/readyz").json()["detail"] == "the server failed to start; its log says why"
            assert http.post("/pipelines/chat", json={"input": "hi"}).json()["type"].endswith("start_failed")
    finally:
        server.stop()
    assert "no such file" in app.state.inferline.start_error
