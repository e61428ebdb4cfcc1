"""pipelines/order_status.yaml served by the app with its real tools on loopback: the HTTP order service and
the MCP example over stdio. The caller's bearer token never reaches a tool; each call is in the audit record
and in /metrics."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sqlite3
import sys
import time
from pathlib import Path

import pytest
from litestar.testing import TestClient

from serving.cli.main import main
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.engine import make_engine
from store.keys import KeyStore
from tests.fakes import FakeEngines
from tests.serving.console.signin import sign_in
from tests.serving.http.test_app import sse_events
from tests.stages.test_agent import ScriptedEngine, call

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "mcp_orders"
sys.path.insert(0, str(EXAMPLE))
from order_service import OrderService  # noqa: E402

SERVER = """
models:
  smol: {{source: models/smollm2-135m-instruct}}
database: sqlite:///{db}
pipelines: pipelines/
auth: {{enabled: true}}
mcp_servers:
  orders: {{command: [python, {server}]}}
tool_headers:
  orders_api: {{X-Api-Key: {{file: orders.key}}}}
"""


@pytest.fixture
def orders():
    service = OrderService().start()
    yield service
    service.shutdown()
    service.server_close()


def _workspace(tmp_path, monkeypatch, orders, audit_with: str) -> Path:
    """order_status.yaml against *orders*, its audit step with *audit_with*; the server file's path."""
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_AUDIT__MASTER_KEY"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "pipelines").mkdir()
    pipeline = (ROOT / "pipelines" / "order_status.yaml").read_text()
    (tmp_path / "pipelines" / "order_status.yaml").write_text(
        pipeline.replace("http://127.0.0.1:8081", orders.url).replace("log, type: audit, always: true}",
                                                                       "log, type: audit, always: true, "
                                                                       f"with: {audit_with}}}"))
    (tmp_path / "orders.key").write_text("server-key\n")
    config = tmp_path / "inferline.yaml"
    config.write_text(SERVER.format(db=tmp_path / "db.sqlite", server=EXAMPLE / "server.py"))
    return config


def pinned(database: Path, wait_s: float = 10.0) -> list[str]:
    """The MCP tools pinned in *database*, once there are some (the server pins them in the background)."""
    deadline = time.monotonic() + wait_s
    while True:
        with sqlite3.connect(database) as db:
            tools = sorted(row[0] for row in db.execute("SELECT tool FROM tool_pins"))
        if tools or time.monotonic() > deadline:
            return tools
        time.sleep(0.05)


def test_order_status_runs_its_tools_without_passing_the_callers_token(tmp_path, monkeypatch, orders):
    config = _workspace(tmp_path, monkeypatch, orders, "{content: full}")
    keys = KeyStore(make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    engine = ScriptedEngine(
        json.dumps([{"name": "order_lookup", "arguments": {"order_id": "A-1001"}},
                    {"name": "order_status", "arguments": {"order_id": "A-1001"}}]),
        call("cancel_order", order_id="A-1001"),
        "A-1001 shipped with DHL.")
    with TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=engine))) as client:
        _, caller = keys.create("app", "caller")
        _, auditor = keys.create("reviewer", "auditor")
        assert pinned(tmp_path / "db.sqlite") == ["answer/orders/order_status"]  # as it started, before a request
        response = client.post("/pipelines/order_status", json={"input": "Where is A-1001?"},
                               headers={"Authorization": f"Bearer {caller}"})
        assert response.status_code == 200, response.text
        assert response.json()["output"] == "A-1001 shipped with DHL."
        [(path, headers)] = orders.seen
        assert path == "/orders/A-1001" and headers["X-Api-Key"] == "server-key"
        assert caller not in json.dumps(headers) and "Authorization" not in headers
        assert "shipped on 2026-03-02" in engine.prompts[1] and "DHL" in engine.prompts[1]
        assert "cancel_order" not in engine.prompts[0]

        auth = {"Authorization": f"Bearer {auditor}"}
        record_id = client.get("/audit/records", headers=auth).json()["records"][0]["id"]
        stages = client.get(f"/audit/records/{record_id}", headers=auth).json()["stages"]
        tools = [s["step"]["tool"] for s in stages if s["type"] == "tool"]
        # The first round's two calls ran side by side: recorded as each ended.
        assert sorted((t["tool"], t["kind"], t["outcome"]) for t in tools[:2]) == [
            ("order_lookup", "http", "ok"), ("order_status", "mcp", "ok")]
        assert (tools[2]["tool"], tools[2]["kind"], tools[2]["outcome"]) == ("cancel_order", "", "refused")
        mcp = next(t for t in tools if t["kind"] == "mcp")
        assert mcp["server"] == "orders" and len(mcp["schema_sha256"]) == 64
        assert all(len(t["arguments_sha256"]) == 64 for t in tools)
        metrics = client.get("/metrics", headers=auth).text
        assert 'inferline_tool_calls_total{outcome="ok",tool="order_status"} 1.0' in metrics
        assert 'inferline_tool_calls_total{outcome="refused",tool="cancel_order"} 1.0' in metrics


def test_tool_values_are_encrypted_with_the_content_and_erased_with_it(tmp_path, monkeypatch, orders, capsys):
    config = _workspace(tmp_path, monkeypatch, orders, "{content: encrypted, subject: tags.user}")
    monkeypatch.setenv("INFERLINE_AUDIT__MASTER_KEY", base64.b64encode(os.urandom(32)).decode())
    keys = KeyStore(make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    engine = ScriptedEngine(call("order_status", order_id="A-1001"), "A-1001 shipped with DHL.")
    with TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=engine))) as client:
        _, caller = keys.create("app", "caller")
        _, auditor = keys.create("reviewer", "auditor")
        response = client.post("/pipelines/order_status", json={"input": "Where is A-1001?", "tags": {"user": "ann"}},
                               headers={"Authorization": f"Bearer {caller}"})
        assert response.status_code == 200, response.text
        auth = {"Authorization": f"Bearer {auditor}"}
        record_id = client.get("/audit/records", headers=auth).json()["records"][0]["id"]
        shown = client.get(f"/audit/records/{record_id}", headers=auth).json()
        [tool] = [s["step"]["tool"] for s in shown["stages"] if s["type"] == "tool"]
        assert tool["content"].startswith("enc:v1:") and "arguments_sha256" not in tool
        [values] = shown["decrypted"]["tools"]
        assert values["stage_id"] == "order_status" and values["arguments"] == {"order_id": "A-1001"}
        assert "shipped on 2026-03-02" in values["result"]
        with sqlite3.connect(tmp_path / "db.sqlite") as db:  # no value in plain text, nor its hash
            dump = "\n".join(db.iterdump())
        assert "2026-03-02" not in dump and '"order_id"' not in dump
        assert hashlib.sha256(b'{"order_id":"A-1001"}').hexdigest() not in dump
        sign_in(client, auditor)
        page = client.get(f"/ui/audit/records/{record_id}").text
        assert 'id="tool-values"' in page and "shipped on 2026-03-02" in page

        assert main(["audit", "erase", "--subject", "tags.user:ann", "--by", "dpo", "--config", str(config)]) == 0
        shown = client.get(f"/audit/records/{record_id}", headers=auth).json()
        assert shown["content_erased"] is True and shown["decrypted"] is None
        assert main(["audit", "verify", "--config", str(config)]) == 0


FAQ = """
name: faq
stages:
  - {id: answer, type: llm, with: {model: smol, client_params: [temperature]}}
"""
HELPER = """
name: helper
stages:
  - id: answer
    type: agent
    with:
      model: smol
      tools: [{kind: pipeline, name: ask_faq, pipeline: faq, description: "Answers from the FAQ."}]
  - {id: log, type: audit, always: true, with: {content: full}}
"""


def test_a_pipeline_tool_takes_its_callees_arguments_as_post_pipelines_does(tmp_path, monkeypatch, orders):
    config = _workspace(tmp_path, monkeypatch, orders, "{content: full}")
    (tmp_path / "pipelines" / "faq.yaml").write_text(FAQ)
    (tmp_path / "pipelines" / "helper.yaml").write_text(HELPER)
    engine = ScriptedEngine(
        json.dumps({"name": "ask_faq", "arguments": {"input": "Returns?", "top_k": 3}}),  # not an option of faq
        json.dumps({"name": "ask_faq", "arguments": {"input": "Returns?", "temperature": None}}),  # as left out
        "Returns: 30 days.",
        json.dumps({"name": "ask_faq", "arguments": {"input": "Returns?", "temperature": 0.25,
                                                     "tags": {"topic": "returns"}}}),
        "Returns take 30 days.", "You have 30 days.")
    keys = KeyStore(make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    with TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=engine))) as client:
        response = client.post("/pipelines/helper", json={"input": "How long do I have to return?"},
                               headers={"Authorization": f"Bearer {keys.create('app', 'caller')[1]}"})
        assert response.status_code == 200, response.text
        assert response.json()["output"] == "You have 30 days."
    offered = json.loads(engine.prompts[0].split("You can call these functions:\n", 1)[1].split("\n", 1)[0])
    assert set(offered["parameters"]["properties"]) == {"input", "tags", "temperature"}
    assert "invalid arguments" in engine.prompts[1] and "top_k" in engine.prompts[1]
    assert "Returns: 30 days." in engine.prompts[3]  # a null option is one left out, as on the HTTP route
    assert engine.samplings[4].temperature == 0.25  # the callee's model call, with the option the tool passed
    assert "Returns take 30 days." in engine.prompts[5]


STAND_IN_RAG = """
name: rag
stages:
  - {id: answer, type: llm, with: {model: smol}}
"""


def test_the_concierge_example_asks_order_status_which_runs_its_own_tools(tmp_path, monkeypatch, orders):
    config = _workspace(tmp_path, monkeypatch, orders, "{content: full}")
    concierge = (ROOT / "pipelines" / "concierge.yaml").read_text().replace(
        "log, type: audit, always: true}", "log, type: audit, always: true, with: {content: full}}")
    (tmp_path / "pipelines" / "concierge.yaml").write_text(concierge)
    (tmp_path / "pipelines" / "rag.yaml").write_text(STAND_IN_RAG)  # the handbook's: not asked here
    engine = ScriptedEngine(call("order_desk", input="Where is A-1001?"), call("order_status", order_id="A-1001"),
                            "A-1001 shipped with DHL.", "Your order A-1001 shipped with DHL.")
    keys = KeyStore(make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    with TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=engine))) as client:
        _, caller = keys.create("app", "caller")
        _, auditor = keys.create("reviewer", "auditor")
        response = client.post("/pipelines/concierge", json={"input": "Where is my order A-1001?"},
                               headers={"Authorization": f"Bearer {caller}"})
        assert response.status_code == 200, response.text
        assert response.json()["output"] == "Your order A-1001 shipped with DHL."
        assert "order_desk" in engine.prompts[0] and "handbook" in engine.prompts[0]
        assert "shipped on 2026-03-02" in engine.prompts[2]  # order_status's own MCP tool ran
        auth = {"Authorization": f"Bearer {auditor}"}
        [record] = client.get("/audit/records", headers=auth).json()["records"]  # one record: the callee's nest
        stages = client.get(f"/audit/records/{record['id']}", headers=auth).json()["stages"]
        tools = {(s["stage_id"], s["step"]["tool"]["kind"], s["step"].get("parent")) for s in stages
                 if s["type"] == "tool"}
        assert tools == {("order_desk", "pipeline", "answer"), ("order_status", "mcp", "answer/order_desk/answer")}


def test_a_streamed_request_sends_each_tool_call_as_it_runs(tmp_path, monkeypatch, orders):
    config = _workspace(tmp_path, monkeypatch, orders, "{content: full}")
    (tmp_path / "pipelines" / "concierge.yaml").write_text((ROOT / "pipelines" / "concierge.yaml").read_text())
    (tmp_path / "pipelines" / "rag.yaml").write_text(STAND_IN_RAG)
    engine = ScriptedEngine(call("order_desk", input="Where is A-1001?"), call("order_status", order_id="A-1001"),
                            "A-1001 shipped with DHL.", "Your order A-1001 shipped with DHL.")
    keys = KeyStore(make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    with TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=engine))) as client:
        response = client.post("/pipelines/concierge", json={"input": "Where is my order A-1001?", "stream": True},
                               headers={"Authorization": f"Bearer {keys.create('app', 'caller')[1]}"})
    assert response.status_code == 200, response.text
    stages = [(d["id"], d["type"], d["status"], d.get("parent", "")) for kind, d in sse_events(response.text)
              if kind == "stage"]
    calls = [s for s in stages if s[1] == "tool"]
    assert calls == [("order_desk", "tool", "started", "answer"),
                     ("order_status", "tool", "started", "answer/order_desk/answer"),
                     ("order_status", "tool", "ok", "answer/order_desk/answer"),
                     ("order_desk", "tool", "ok", "answer")]
    assert ("answer", "agent", "started", "answer/order_desk") in stages  # the callee's own steps, live
