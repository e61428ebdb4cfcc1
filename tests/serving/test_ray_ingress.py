"""The HTTP app as two Ray Serve ingress replicas (``ray_ingress: {num_replicas: 2}``) on a local Ray started
here, behind Ray's HTTP proxy, sharing state the way a cluster does: the audit log in PostgreSQL (a scratch
schema of database ``test`` on 127.0.0.1:5432) and the rate limits in Redis (127.0.0.1:6379).

SSE through the proxy says what the single-process server says; a Redis limit holds in total across the
replicas; both replicas write one audit chain that ``inferline audit verify`` accepts."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).parents[2]
SOURCE = ROOT / "models" / "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"
POSTGRES_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
REPLICA = "x-inferline-replica"
EXE = Path(sys.executable).with_name("inferline")
LIMIT = 4

LIMITED = f"""
name: limited
stages:
  - {{id: guard, type: policy, with: {{limits: {{requests_per_minute: {LIMIT}, per: pipeline}}}}}}
  - {{id: prompt, type: prompt}}
  - {{id: tok, type: tokenize}}
  - {{id: gen, type: generate, with: {{max_tokens: 2, temperature: 0}}}}
  - {{id: out, type: stream}}
  - {{id: log, type: audit, always: true}}
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url():
    """A URL whose connections see only a fresh schema of the test database (dropped afterwards), migrated:
    replicas that start at once on an empty database would race to create its tables."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    from store.engine import make_engine
    from store.migrate import create_schema

    schema = f"inferline_ray_{uuid.uuid4().hex[:12]}"
    base = make_url(POSTGRES_URL).update_query_dict({"connect_timeout": "5"})
    admin = make_engine(base.render_as_string(hide_password=False))
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        pytest.fail(f"PostgreSQL at {base.render_as_string()} is unreachable ({str(exc.orig).strip()}); start it, "
                    "or deselect with -m 'not integration'.", pytrace=False)
    url = base.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)
    try:
        engine = make_engine(url)
        create_schema(engine)
        engine.dispose()
        yield url
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(scope="module")
def redis_prefix():
    """A Redis key prefix of this module's own (its keys deleted afterwards); Redis absent fails loudly."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        pytest.fail(f"Redis at {REDIS_URL} is unreachable ({exc}); start it, or deselect with -m 'not integration'.",
                    pytrace=False)
    prefix = f"inferline-ray-{uuid.uuid4().hex[:8]}"
    try:
        yield prefix
    finally:
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


def write_workspace(root: Path, *, database: str, ray: bool, limits: dict | None = None) -> Path:
    """The chat and limited pipelines over the bundled model: a ray model with two ingress replicas, or local."""
    (root / "pipelines").mkdir()
    shutil.copy(ROOT / "pipelines" / "chat.yaml", root / "pipelines" / "chat.yaml")
    (root / "pipelines" / "limited.yaml").write_text(textwrap.dedent(LIMITED))
    model = {"source": str(SOURCE), "device": "cpu", "dtype": "float32", "kv_cache": {"memory_gb": 0.25}}
    server: dict = {"database": database, "auth": {"enabled": False}, "pipelines": "pipelines/",
                    "telemetry": {"exporter": "none"}}
    if ray:
        model |= {"backend": "ray", "ray": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}}
        server["ray_ingress"] = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}}
    if limits:
        server["limits"] = limits
    config = root / "inferline.yaml"
    config.write_text(yaml.safe_dump({"models": {"smol": model}, **server}))
    return config


@pytest.fixture(scope="module")
def app(tmp_path_factory, postgres_url, redis_prefix):
    """The serve-deploy application (two ingress replicas, one engine) on a local Ray: (url, config path)."""
    ray = pytest.importorskip("ray")
    from serving.backends.ray_deploy import APP_NAME
    from serving.backends.ray_serve import serve
    from serving.ray_ingress import build_app

    config = write_workspace(tmp_path_factory.mktemp("ray-ingress"), database=postgres_url, ray=True,
                             limits={"backend": "redis", "redis_url": REDIS_URL, "prefix": redis_prefix})
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"config": str(config)}), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/readyz", timeout=60).status_code == 200
        yield url, config
    finally:
        serve.shutdown()
        ray.shutdown()


def sse_events(text: str) -> list[tuple[str, dict]]:
    events = []
    for block in text.replace("\r\n", "\n").strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            events.append((fields.get("event", "message"), json.loads(fields["data"])))
    return events


def streamed_answer(events: list[tuple[str, dict]]) -> tuple[str, str, int, str]:
    """(text of the deltas, done's output, output tokens, finish reason) of an SSE answer."""
    kinds = [kind for kind, _ in events]
    assert kinds[-1] == "done", events[-1]
    done = events[-1][1]
    text = "".join(data["text"] for kind, data in events if kind == "delta")
    return text, done["output"], done["usage"]["output_tokens"], done["finish_reason"]


def single_process_answer(tmp_path: Path) -> tuple[str, str, int, str]:
    """The chat pipeline's SSE answer from the single-process server (in this process, the local engine)."""
    from litestar.testing import TestClient

    from serving.runtime.workspace import open_workspace
    from serving.server import create_server

    config = write_workspace(tmp_path, database=f"sqlite:///{tmp_path / 'single.db'}", ray=False)
    with TestClient(create_server(open_workspace(str(config))), timeout=120) as client:
        response = client.post("/pipelines/chat", json={"input": QUESTION, "stream": True})
        assert response.status_code == 200, response.text
        return streamed_answer(sse_events(response.text))


def test_sse_through_the_ray_proxy_is_what_the_single_process_server_streams(app, tmp_path):
    url, _ = app
    with httpx.stream("POST", f"{url}/pipelines/chat", json={"input": QUESTION, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers[REPLICA]
        chunks = [chunk for chunk in response.iter_text()]
    events = sse_events("".join(chunks))
    assert events[0][0] == "stage"
    through_ray = streamed_answer(events)
    assert through_ray[0] == through_ray[1] and through_ray[2] > 0
    assert through_ray == single_process_answer(tmp_path)


def _served(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_a_redis_rate_limit_holds_in_total_across_ingress_replicas(app, fresh_minute):
    url, _ = app
    answers = []
    # Until both replicas have answered (Ray's proxy spreads requests at random), at most 40 calls.
    while len(answers) < 2 * LIMIT + 2 or len({r.headers[REPLICA] for r in answers}) < 2:
        assert len(answers) < 40, Counter(r.headers[REPLICA] for r in answers)
        answers.append(_served(url, "/pipelines/limited", {"input": "Hi"}))
    statuses = Counter(r.status_code for r in answers)
    assert statuses == {200: LIMIT, 429: len(answers) - LIMIT}, statuses
    assert [r.status_code for r in answers[:LIMIT]] == [200] * LIMIT
    assert [r.headers["x-ratelimit-remaining-requests"] for r in answers[:LIMIT]] == ["3", "2", "1", "0"]
    # Each replica alone would have let LIMIT through: the refusals come from both, whichever served the 200s.
    assert len({r.headers[REPLICA] for r in answers}) == 2


def _audit_cli(config: Path, *argv: str) -> subprocess.CompletedProcess:
    """``inferline audit ARGV --config CONFIG``, the command a reviewer runs."""
    return subprocess.run([EXE, "audit", *argv, "--config", str(config)], capture_output=True, text=True,
                          timeout=120, cwd=config.parent)


def _records(database: str) -> list[dict]:
    """Every record of the chain (kind record), oldest first."""
    from store.audit import AuditFilters, AuditStore
    from store.engine import make_engine

    engine = make_engine(database)
    try:
        store = AuditStore(engine, spool_path=Path(os.devnull))
        records, cursor = [], None
        while True:
            page = store.query(AuditFilters(), sort="seq", cursor=cursor, limit=500)
            records += page.records
            if (cursor := page.next_cursor) is None:
                return records
    finally:
        engine.dispose()


def test_two_ingress_replicas_write_one_audit_chain(app, postgres_url):
    url, config = app
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda i: _served(url, "/pipelines/chat", {"input": f"Say {i}.", "max_tokens": 3}),
                                range(12)))
    assert [r.status_code for r in answers] == [200] * 12
    writers = Counter(r.headers[REPLICA] for r in answers)
    request_ids = {r.json()["request_id"] for r in answers}
    # An answer waits for its record in the journal; the chain in the database follows within moments
    # (the API's audit reads wait for it; this reads the table straight). Counted by request id: an
    # earlier test's last record may still be joining the chain while these are sent.
    deadline = time.monotonic() + 15
    records = _records(postgres_url)
    while not request_ids <= {record["request_id"] for record in records} and time.monotonic() < deadline:
        time.sleep(0.2)
        records = _records(postgres_url)
    ours = Counter(record["request_id"] for record in records if record["request_id"] in request_ids)
    assert len(request_ids) == 12 and ours == dict.fromkeys(request_ids, 1)  # each answer audited once
    assert [record["seq"] for record in records] == list(range(records[0]["seq"], records[0]["seq"] + len(records)))
    verify = _audit_cli(config, "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    checked = re.match(r"ok: (\d+) record\(s\) checked, head seq", verify.stdout.strip().splitlines()[-1])
    assert checked and int(checked[1]) >= len(records), verify.stdout
    # Both replicas wrote into it (if the proxy happened to pick one replica for all 12, this says so).
    assert len(writers) == 2, writers
