"""pipelines/order_status.yaml served by the app with its real tools on loopback: the HTTP order service and
the MCP example over stdio. The caller's bearer token never reaches a tool; each call is in the audit record
and in /metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from litestar.testing import TestClient

from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.engine import make_engine
from store.keys import KeyStore
from tests.fakes import FakeEngines
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


def test_order_status_runs_its_tools_without_passing_the_callers_token(tmp_path, monkeypatch, orders):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "pipelines").mkdir()
    pipeline = (ROOT / "pipelines" / "order_status.yaml").read_text()
    (tmp_path / "pipelines" / "order_status.yaml").write_text(
        pipeline.replace("http://127.0.0.1:8081", orders.url).replace("log, type: audit, always: true}",
                                                                       "log, type: audit, always: true, "
                                                                       "with: {content: full}}"))
    (tmp_path / "orders.key").write_text("server-key\n")
    config = tmp_path / "inferline.yaml"
    config.write_text(SERVER.format(db=tmp_path / "db.sqlite", server=EXAMPLE / "server.py"))
    keys = KeyStore(make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    engine = ScriptedEngine(
        json.dumps([{"name": "order_lookup", "arguments": {"order_id": "A-1001"}},
                    {"name": "order_status", "arguments": {"order_id": "A-1001"}}]),
        call("cancel_order", order_id="A-1001"),
        "A-1001 shipped with DHL.")
    with TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=engine))) as client:
        _, caller = keys.create("app", "caller")
        _, auditor = keys.create("reviewer", "auditor")
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
