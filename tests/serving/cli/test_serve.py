"""A real ``inferline serve`` process on loopback, with the real model and auth on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).parents[3]
EXE = Path(sys.executable).with_name("inferline")
QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One server process; keys are created with the real CLI."""

    def __init__(self, tmp: Path, *, auth: bool = True, pipelines: Path = ROOT / "pipelines", extra: str = ""):
        self.config = tmp / "inferline.yaml"
        self.config.write_text(
            (ROOT / "inferline.yaml").read_text()
            .replace("source: models/", f"source: {ROOT}/models/")
            .replace("auth: {enabled: false}", f"auth: {{enabled: {str(auth).lower()}}}")
            .replace("pipelines: pipelines/", f"pipelines: {pipelines}/")
            .replace("path: indexes/", f"path: {ROOT}/indexes/")  # the indexes `make install` built
            .replace("database: sqlite:///inferline.db", f"database: sqlite:///{tmp}/server.db") + extra)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / "server.log", "w")  # noqa: SIM115 - closed in stop()
        # This checkout's code, whichever checkout the environment's editable install points at.
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([EXE, "serve", "--config", self.config, "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp, env=env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited: {self.proc.returncode}"
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise AssertionError("server not ready after 180 s")

    def key(self, role: str) -> str:
        out = subprocess.run([EXE, "keys", "create", "--role", role, "--name", f"test-{role}", "--config",
                              self.config], capture_output=True, text=True, check=True, cwd=self.config.parent,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        return out.stdout.strip()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.log.close()
        return code


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("server"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def caller_key(server) -> str:
    return server.key("caller")


def readiness(server: Server, key: str) -> dict:
    return httpx.get(f"{server.url}/readyz", headers={"Authorization": f"Bearer {key}"}).json()["models"]["smol"]


def test_openai_client_chat(server, caller_key):
    client = OpenAI(base_url=f"{server.url}/v1", api_key=caller_key)
    reply = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": QUESTION}])
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": QUESTION}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The capital of France is Paris."
    assert chunks[-1].usage.total_tokens == reply.usage.total_tokens
    assert "chat" in [model.id for model in client.models.list()]


def test_sse_pipeline_route(server, caller_key):
    headers = {"Authorization": f"Bearer {caller_key}"}
    with httpx.stream("POST", f"{server.url}/pipelines/chat", json={"input": QUESTION, "stream": True},
                      headers=headers, timeout=60) as response:
        text = response.read().decode()
    events = [block for block in text.replace("\r\n", "\n").split("\n\n") if block.strip()]
    done = json.loads(events[-1].split("data: ", 1)[1])
    assert events[-1].startswith("event: done")
    assert done["output"] == "The capital of France is Paris." and done["usage"]["output_tokens"] == 8


def test_structured_output_end_to_end(server, caller_key):
    headers = {"Authorization": f"Bearer {caller_key}"}
    text = "Mary Jones, 35, moved from Leeds to Bristol last May."
    body = httpx.post(f"{server.url}/pipelines/extract", json={"input": text}, headers=headers, timeout=60).json()
    record = json.loads(body["output"])
    assert set(record) == {"name", "age", "city"} and isinstance(record["age"], int)
    assert body["finish_reason"] == "stop"
    bad = httpx.post(f"{server.url}/pipelines/chat", headers=headers, timeout=60,
                     json={"input": "hi", "output": {"json_schema": {"type": "object", "not": {}}}})
    assert bad.status_code == 400 and "Unimplemented keys: [\"not\"]" in bad.json()["detail"]


def test_auth_against_the_real_server(server, caller_key):
    auditor = server.key("auditor")
    body = {"input": QUESTION}
    assert httpx.post(f"{server.url}/pipelines/chat", json=body).status_code == 401
    denied = httpx.post(f"{server.url}/pipelines/chat", json=body, headers={"Authorization": f"Bearer {auditor}"})
    assert denied.status_code == 403 and denied.headers["content-type"].startswith("application/problem+json")


def test_disconnect_frees_the_engine(server, caller_key):
    headers = {"Authorization": f"Bearer {caller_key}"}
    body = {"input": "Write a long story about a dragon who learns to cook.", "stream": True}
    with httpx.stream("POST", f"{server.url}/pipelines/chat", json=body, headers=headers, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("event: delta"):
                break  # leave mid-stream: closing the connection is the disconnect
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        models = readiness(server, caller_key)
        if models["running"] == 0 and models["kv_usage"] == 0:
            break
        time.sleep(0.1)
    assert readiness(server, caller_key) == {"backend": "local", "replicas": 1, "running": 0, "waiting": 0,
                                             "kv_usage": 0.0}
    auditor = {"Authorization": f"Bearer {server.key('auditor')}"}
    records = httpx.get(f"{server.url}/audit/records", params={"status": "disconnected"}, headers=auditor).json()
    assert [(r["status"], r["http_status"]) for r in records["records"]] == [("disconnected", 499)]
    assert httpx.get(f"{server.url}/audit/verify", headers=auditor).json()["ok"] is True


def test_metrics_parse(server, caller_key):
    admin = server.key("admin")
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {admin}"}).text
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {"inferline_time_to_first_token_seconds", "inferline_inter_token_latency_seconds",
            "inferline_num_requests_running", "inferline_kv_cache_usage_perc", "inferline_prefix_cache_queries",
            "inferline_pipeline_requests", "inferline_stage_duration_seconds", "inferline_pipeline_cost_usd",
            } <= names


def test_sigterm_drains_in_flight_streams(tmp_path):
    server = Server(tmp_path)
    key = server.key("caller")
    result: dict[str, str] = {}

    def stream() -> None:
        body = {"input": "Tell me about the history of Paris.", "stream": True, "max_tokens": 96}
        with httpx.stream("POST", f"{server.url}/pipelines/chat", json=body,
                          headers={"Authorization": f"Bearer {key}"}, timeout=120) as response:
            result["text"] = response.read().decode()

    worker = threading.Thread(target=stream)
    worker.start()
    time.sleep(1.0)  # the request is generating
    assert server.stop() == 0
    worker.join(timeout=60)
    assert "event: done" in result.get("text", ""), result


def test_an_edit_under_load_reloads_on_sighup_without_failing_a_stream(tmp_path):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    chat = folder / "chat.yaml"
    original = (ROOT / "pipelines" / "chat.yaml").read_text()
    chat.write_text(original)
    # No watcher: SIGHUP alone reloads, so the moment of the swap is the test's.
    server = Server(tmp_path, auth=False, pipelines=folder, extra="reload: {watch: false}\n")
    finals: list[dict] = []

    def stream(n: int) -> None:
        body = {"input": f"Tell me about the history of Paris, part {n}.", "stream": True, "max_tokens": 24}
        with httpx.stream("POST", f"{server.url}/pipelines/chat", json=body, timeout=120) as response:
            text = response.read().decode()
        finals.append(json.loads(text.replace("\r\n", "\n").split("event: done\ndata: ", 1)[1].split("\n")[0]))

    try:
        workers = [threading.Thread(target=stream, args=(n,)) for n in range(8)]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/readyz").json()["models"]["smol"]["running"] < 1:
            assert time.monotonic() < deadline, "no stream started"
            time.sleep(0.05)
        chat.write_text(original.replace("name: chat", "name: chat\nversion: '2'"))
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/pipelines/chat").json()["version"] != "2":
            assert time.monotonic() < deadline, "SIGHUP did not reload"
            time.sleep(0.05)
        after = httpx.post(f"{server.url}/pipelines/chat", json={"input": QUESTION, "max_tokens": 8}, timeout=60)
        assert after.status_code == 200 and after.json()["pipeline_version"] == "2"
        for worker in workers:
            worker.join(timeout=120)
        assert len(finals) == 8 and {f["finish_reason"] for f in finals} <= {"stop", "length"}
        assert sum(f["pipeline_version"] == "1" for f in finals) >= 1  # those running at the swap finished on 1

        chat.write_text(original.replace("type: tokenize", "type: tokenise"))
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while (error := httpx.get(f"{server.url}/pipelines/chat").json()["reload_error"]) is None:
            assert time.monotonic() < deadline, "the bad edit was not reported"
            time.sleep(0.05)
        assert error["issues"][0]["line"] == 14 and "tokenise" in error["issues"][0]["message"]
        still = httpx.post(f"{server.url}/pipelines/chat", json={"input": QUESTION, "max_tokens": 8}, timeout=60)
        assert still.status_code == 200 and still.json()["pipeline_version"] == "2"
    finally:
        assert server.stop() == 0
    log = (tmp_path / "server.log").read_text()
    assert "did not load; 'chat' keeps serving its running version" in log and "chat.yaml:14:" in log


def test_a_model_that_fails_to_load_fails_liveness_and_the_process_exits_1(tmp_path):
    # The server listens before its models load (a liveness probe sees it alive meanwhile); a model that
    # cannot load turns /healthz to 503 and the process exits 1 with the cause in its log.
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "chat.yaml").write_text((ROOT / "pipelines" / "chat.yaml").read_text())
    config = tmp_path / "inferline.yaml"
    config.write_text(f"models:\n  smol: {{source: {tmp_path}/missing.gguf}}\ndatabase: sqlite:///{tmp_path}/s.db\n"
                      "pipelines: pipelines/\n")
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.run([EXE, "serve", "--config", config, "--port", str(free_port())], stdout=out,
                              stderr=subprocess.STDOUT, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              timeout=120)
    text = log.read_text()
    assert proc.returncode == 1, text
    assert "Uvicorn running on" in text and "the server failed to start: model 'smol' failed to start" in text
    assert text.index("Uvicorn running on") < text.index("the server failed to start")
