"""``inferline serve --ray`` from the command line: it starts a local Ray, deploys the engine, answers HTTP
(JSON and SSE; a chain and the triage workflow), and on SIGTERM drains, exits 0 and takes its Ray with it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).parents[3]
EXE = Path(sys.executable).with_name("inferline")
QUESTION = "What is the capital of France?"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _workspace(root: Path) -> Path:
    (root / "pipelines").mkdir()
    for name in ("chat", "triage"):  # a chain, and a workflow of three model calls in its branches
        (root / "pipelines" / f"{name}.yaml").write_text((ROOT / "pipelines" / f"{name}.yaml").read_text())
    config = root / "inferline.yaml"
    config.write_text(yaml.safe_dump({
        "models": {"smol": {"backend": "ray", "source": str(ROOT / "models" / "smollm2-135m-instruct"),
                            "device": "cpu", "dtype": "float32", "kv_cache": {"memory_gb": 0.25},
                            "ray": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}}},
        "database": f"sqlite:///{root / 'inferline.db'}", "auth": {"enabled": False}, "pipelines": "pipelines/",
        "telemetry": {"exporter": "none"},
    }))
    return config


def _sse_done(text: str) -> tuple[str, dict]:
    blocks = [block for block in text.replace("\r\n", "\n").split("\n\n") if block.strip()]
    assert blocks[-1].startswith("event: done"), blocks[-1]
    deltas = [json.loads(block.split("data: ", 1)[1])["text"] for block in blocks if block.startswith("event: delta")]
    return "".join(deltas), json.loads(blocks[-1].split("data: ", 1)[1])


def test_serve_ray_answers_then_exits_0_on_sigterm_and_stops_its_ray(tmp_path):
    config = _workspace(tmp_path)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(ROOT)}
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([EXE, "serve", "--ray", "--config", str(config), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    url = f"http://127.0.0.1:{port}"
    ray_processes: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"serve --ray exited {proc.returncode}: {(tmp_path / 'serve.log').read_text()}"
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve --ray not ready after 180 s"
            time.sleep(0.5)
        # Its local Ray: GCS, raylet and the workers (Serve's controller, proxy, the engine replica).
        ray_processes = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in p.name() or "gcs_server" in p.name() for p in ray_processes), ray_processes

        answer = httpx.post(f"{url}/pipelines/chat", json={"input": QUESTION}, timeout=120)
        assert answer.status_code == 200, answer.text
        with httpx.stream("POST", f"{url}/pipelines/chat", json={"input": QUESTION, "stream": True},
                          timeout=120) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            text, done = _sse_done(response.read().decode())
        assert text == done["output"] == answer.json()["output"]
        assert "Paris" in text and done["usage"]["output_tokens"] > 0
        # The triage workflow on the same Ray engine: its classifier's JSON (constrained decoding in the
        # replica), one branch answering, the others skipped.
        triaged = httpx.post(f"{url}/pipelines/triage", json={"input": "The app crashes when I open settings."},
                             timeout=120)
        assert triaged.status_code == 200, triaged.text
        statuses = {stage["id"]: stage["status"] for stage in triaged.json()["stages"]}
        assert statuses["classify"] == "ok" and triaged.json()["output"].strip()
        assert sorted(statuses[b] for b in ("escalate", "refund", "tech", "other")) == ["ok", "skipped", "skipped",
                                                                                       "skipped"]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, (tmp_path / "serve.log").read_text()
        # Ray's processes go with it.
        _, alive = psutil.wait_procs(ray_processes, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for process in ray_processes:  # a failed run must not leave its Ray behind
            if process.is_running():
                process.kill()
        log.close()
