"""The ``serve deploy`` path on a local Ray started by the test: the application ``build_app`` returns
(ingress + an engine deployment), answering HTTP through Ray Serve's proxy; and a replica that dies."""

from __future__ import annotations

import shutil
import socket
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).parents[2]
SOURCE = ROOT / "models" / "smollm2-135m-instruct"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _workspace(tmp_path: Path) -> Path:
    """A server file with one ``backend: ray`` model (absolute source), sqlite, auth off, the chat pipeline."""
    (tmp_path / "pipelines").mkdir()
    shutil.copy(ROOT / "pipelines" / "chat.yaml", tmp_path / "pipelines" / "chat.yaml")
    config = tmp_path / "inferline.yaml"
    config.write_text(yaml.safe_dump({
        "models": {"smol": {"backend": "ray", "source": str(SOURCE), "device": "cpu", "dtype": "float32",
                            "kv_cache": {"memory_gb": 0.25},
                            "ray": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}}},
        "database": f"sqlite:///{tmp_path / 'inferline.db'}",
        "auth": {"enabled": False},
        "pipelines": "pipelines/",
        "telemetry": {"exporter": "none"},
    }))
    return config


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    from serving.backends.ray_serve import serve

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield serve, f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_serve_deploy_app_answers_a_pipeline_over_http(local_ray, tmp_path):
    from serving.backends.ray_deploy import APP_NAME
    from serving.ray_ingress import build_app

    serve, url = local_ray
    config = _workspace(tmp_path)
    serve.run(build_app({"config": str(config)}), name=APP_NAME, route_prefix="/")
    with httpx.Client(base_url=url, timeout=60) as client:
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["status"] == "ready"
        assert ready.json()["pipelines"] == ["chat"]
        response = client.post("/pipelines/chat", json={"input": "What is the capital of France?"})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["output"].strip()
        assert body["finish_reason"] in ("stop", "length")
        assert body["usage"]["output_tokens"] > 0


def _replica_actors(app: str, deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["namespace"] == "serve" and actor["name"].startswith(prefix)]


FALLBACK = """
name: p
stages:
  - {id: prompt, type: prompt}
  - {id: pick, type: route, with: {default: smol, fallback: [local], first_token_timeout_s: 0.5}}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 16, temperature: 0}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true}
"""

#: No fallback: a replica dying mid-stream fails the request (503, retryable), and its record says so.
LONG = """
name: long
stages:
  - {id: prompt, type: prompt}
  - {id: pick, type: route, with: {default: smol}}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 2000, temperature: 0, ignore_eos: true}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true}
"""


def _pipeline(registry, text: str, ray_engine, audit):
    """A pipeline routed to the ray model *ray_engine* (model ``smol``), with a fake local one as ``local``."""
    from pipeline.loader import load_pipeline_text
    from pipeline.protocols import Catalog, ModelInfo, Resources
    from pipeline.runner import Pipeline
    from tests.fakes import FakeEngine, FakeEngines

    catalog = Catalog(models={"smol": ModelInfo("smol"), "local": ModelInfo("local")})
    engines = FakeEngines(local=FakeEngine("Local answer."))
    engines.engines["smol"] = ray_engine
    loaded = load_pipeline_text(textwrap.dedent(text), "p.yaml", registry, catalog)
    return Pipeline(loaded, Resources(catalog, engines=engines, audit=audit))


def _audit_query(config: Path, *filters: str) -> list[dict]:
    """``inferline audit query FILTERS`` (the reviewers' command) as records, oldest first."""
    import json
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("inferline")
    out = subprocess.run([exe, "audit", "query", "--config", str(config), "--sort", "seq", *filters],
                         capture_output=True, text=True, timeout=120, check=True, cwd=config.parent)
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_a_replica_that_dies_mid_stream_ends_it_with_a_backend_error(local_ray, monkeypatch, registry,
                                                                          tmp_path):
    import asyncio

    import ray

    from pipeline.context import RequestContext
    from pipeline.errors import BackendError
    from pipeline.events import Done, Error, TextDelta
    from pipeline.protocols import SamplingParams
    from pipeline.runner import Runner
    from serving.backends.audit_sink import StoreSink
    from serving.backends.model_pool import ModelPool
    from serving.backends.ray_deploy import APP_NAME, deployment_name
    from serving.backends.ray_engine import RayEngine
    from serving.backends.ray_replica import run_engines
    from serving.config.models import ModelSpec
    from serving.config.server import ServerSpec
    from store.audit import AuditStore
    from store.engine import make_engine
    from store.migrate import create_schema

    monkeypatch.chdir(ROOT)
    config = _workspace(tmp_path)  # its database: where this test's audit records go
    database = make_engine(f"sqlite:///{tmp_path / 'inferline.db'}")
    create_schema(database)
    sink = StoreSink(AuditStore(database, spool_path=tmp_path / "spool.jsonl"))
    server = ServerSpec(models={"smol": ModelSpec.model_validate(
        {"source": str(SOURCE), "device": "cpu", "dtype": "float32", "kv_cache": {"memory_gb": 0.25},
         "backend": "ray", "ray": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}})})
    assert run_engines(server, ROOT) == ["smol"]
    pool = ModelPool(server, ROOT)
    try:
        engine = await pool.get("smol")
        assert isinstance(engine, RayEngine)
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Count from one to a thousand."}])
        long = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
        stream = await engine.submit(ids, long)
        # A pipeline request streaming from the same replica, without a fallback.
        long_ctx = RequestContext.from_text("long", "Count from one to a thousand.")
        run = Runner().stream(_pipeline(registry, LONG, engine, sink), long_ctx)
        long_events = [await asyncio.wait_for(anext(run), timeout=60)]
        while not isinstance(long_events[-1], TextDelta):
            long_events.append(await asyncio.wait_for(anext(run), timeout=60))
        [before] = _replica_actors(APP_NAME, deployment_name("smol"))
        ray.kill(ray.get_actor(before, namespace="serve"), no_restart=True)

        async def drain() -> int:
            return len([event async for event in stream])

        with pytest.raises(BackendError, match="the Ray Serve replica failed"):
            await asyncio.wait_for(drain(), timeout=30)

        async def rest() -> list:
            return [event async for event in run]

        long_events += await asyncio.wait_for(rest(), timeout=30)
        assert isinstance(long_events[-1], Error) and long_events[-1].kind == "backend_error", long_events[-1]
        assert engine.outstanding == 0

        # Until Ray Serve has a new replica, a route's fallback answers (the replica is gone or silent).
        ctx = RequestContext.from_text("p", "Hello")
        events = [event async for event in Runner().stream(_pipeline(registry, FALLBACK, engine, sink), ctx)]
        assert isinstance(events[-1], Done), events[-1]
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Local answer."
        assert ctx.model == "local"
        assert ctx.facts["route"]["fallbacks_tried"][0]["model"] == "smol"
        assert ctx.facts["route"]["fallbacks_tried"][0]["error"] == "backend_error"

        # The audit log says which: read back as a reviewer would.
        [failed] = _audit_query(config, "--status", "failed")
        assert (failed["pipeline"], failed["model"], failed["error_type"]) == ("long", "smol", "backend_error")
        assert failed["http_status"] == 503 and failed["output_tokens"] > 0  # it failed mid-stream: retryable
        [fell_back] = _audit_query(config, "--pipeline", "p")
        assert (fell_back["status"], fell_back["model"], fell_back["error_type"]) == ("ok", "local", None)
        assert fell_back["route"]["fallbacks_tried"] == ctx.facts["route"]["fallbacks_tried"]
        assert fell_back["route"]["fallbacks_tried"][0]["error"] == "backend_error"

        # Ray Serve starts a new replica; the same handle reaches it.
        deadline = time.monotonic() + 60
        while True:
            try:
                again = await asyncio.wait_for(
                    engine.submit(ids, SamplingParams(max_tokens=8, temperature=0)), timeout=30)
                events = [event async for event in again]
                break
            except BackendError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        assert events[-1].finish_reason is not None
        assert _replica_actors(APP_NAME, deployment_name("smol")) != [before]
        assert engine.outstanding == 0
    finally:
        await pool.close()
        database.dispose()
