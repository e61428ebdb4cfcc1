"""The tool hub against real servers on loopback: the MCP example over stdio and over streamable HTTP, and the
HTTP order service; then the agent step over the hub: allow list, drift after a server restart, cancellation."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from pipeline.context import RequestContext
from pipeline.errors import BackendError
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Resources
from pipeline.registry import StageRegistry
from pipeline.runner import Pipeline, Runner
from serving.backends.tool_hub import ToolHub
from serving.config.loader import catalog_of
from serving.config.server import ServerSpec
from stages import register_builtins
from store.engine import make_engine
from store.migrate import create_schema
from store.pipeline_versions import ToolPins
from tests.fakes import FakeEngines
from tests.stages.test_agent import ScriptedEngine, Sink, call

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "mcp_orders"
sys.path.insert(0, str(EXAMPLE))
from order_service import OrderService  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_http_mcp(port: int, drift: bool = False) -> subprocess.Popen:
    env = {**os.environ, "ORDERS_DRIFT": "1" if drift else "0"}
    process = subprocess.Popen([sys.executable, str(EXAMPLE / "server.py"), "--http", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return process
        time.sleep(0.05)
    process.kill()
    raise RuntimeError("the MCP example server did not start")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(3)
    except subprocess.TimeoutExpired:  # uvicorn waits for open streams (a client's change subscription)
        process.kill()
        process.wait(10)


@pytest.fixture
def orders():
    service = OrderService().start()
    yield service
    service.shutdown()
    service.server_close()


@pytest.fixture
def http_mcp():
    port = free_port()
    process = start_http_mcp(port)
    yield port, process
    if process.poll() is None:
        stop(process)


def server_spec(orders_url: str = "http://127.0.0.1:1", mcp_port: int = 1, ttl: float = 0) -> ServerSpec:
    return ServerSpec.model_validate({
        "models": {"smol": {"source": "models/smollm2-135m-instruct"}},
        "mcp_servers": {"stdio": {"command": ["python", str(EXAMPLE / "server.py")]},
                        "web": {"url": f"http://127.0.0.1:{mcp_port}/mcp", "schema_ttl_s": ttl}},
        "tool_headers": {"orders_api": {"X-Api-Key": {"env": "ORDERS_API_KEY_FOR_TEST"}}},
    })


@pytest.mark.parametrize("server", ["stdio", "web"])
async def test_mcp_tools_are_listed_with_schema_hashes_and_called(server, http_mcp):
    hub = ToolHub(server_spec(mcp_port=http_mcp[0]), ROOT)
    try:
        tools = await hub.list_mcp(server)
        assert {"order_status", "cancel_order", "slow"} <= set(tools)
        assert tools["order_status"].parameters["required"] == ["order_id"]
        assert len(tools["order_status"].sha256) == 64
        reply = await hub.call_mcp(server, "order_status", {"order_id": "A-1001"})
        assert reply.text == "shipped on 2026-03-02" and not reply.is_error
    finally:
        await hub.aclose()


async def test_an_mcp_call_past_its_timeout_is_cancelled_on_the_server(tmp_path):
    events = tmp_path / "events"
    spec = server_spec()
    spec.mcp_servers["stdio"].env["ORDERS_EVENTS"] = str(events)
    hub = ToolHub(spec, ROOT)
    try:
        await hub.list_mcp("stdio")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await hub.call_mcp("stdio", "slow", {"seconds": 30})
        reply = await hub.call_mcp("stdio", "order_status", {"order_id": "A-1003"})
        assert reply.text == "delivered"  # the server answered the next call: it was not stuck on the last
        for _ in range(100):
            if events.exists():
                break
            await asyncio.sleep(0.05)
        assert events.read_text() == "slow cancelled\n"
    finally:
        await hub.aclose()


async def test_an_unknown_server_is_an_error_that_names_it():
    hub = ToolHub(server_spec(), ROOT)
    with pytest.raises(BackendError, match="no MCP server 'nope'"):
        await hub.list_mcp("nope")
    await hub.aclose()


async def test_http_tools_send_the_servers_headers_encode_arguments_and_cap_responses(orders, monkeypatch):
    monkeypatch.setenv("ORDERS_API_KEY_FOR_TEST", "s3cret")
    hub = ToolHub(server_spec(orders.url), ROOT)
    try:
        reply = await hub.call_http("GET", orders.url + "/orders/{order_id}", {"order_id": "A-1001"},
                                    "orders_api", 65536)
        assert json.loads(reply.text)["status"] == "shipped" and not reply.is_error
        _, headers = orders.seen[-1]
        assert headers["X-Api-Key"] == "s3cret" and "Authorization" not in headers
        await hub.call_http("GET", orders.url + "/orders/{order_id}", {"order_id": "../big"}, None, 65536)
        assert orders.seen[-1][0] == "/orders/..%2Fbig"  # an argument never leaves its path segment
        with pytest.raises(BackendError, match="max_response_bytes"):
            await hub.call_http("GET", orders.url + "/big", {}, None, 1000)
        monkeypatch.delenv("ORDERS_API_KEY_FOR_TEST")
        with pytest.raises(BackendError, match="ORDERS_API_KEY_FOR_TEST is not set"):
            await hub.call_http("GET", orders.url + "/orders/A-1001", {}, "orders_api", 65536)
    finally:
        await hub.aclose()


async def test_a_servers_list_changed_notification_has_its_tools_listed_again():
    hub = ToolHub(server_spec(), ROOT)  # stdio, schema_ttl_s 5: without the notification the listing is kept
    try:
        before = (await hub.list_mcp("stdio"))["order_status"].sha256
        assert (await hub.call_mcp("stdio", "upgrade", {})).text == "order_status upgraded"
        for _ in range(100):
            after = (await hub.list_mcp("stdio"))["order_status"]
            if after.sha256 != before:
                break
            await asyncio.sleep(0.02)
        assert "include_history" in after.parameters["properties"]
    finally:
        await hub.aclose()


def test_tool_calls_are_counted_by_tool_and_outcome():
    registry = CollectorRegistry()
    hub = ToolHub(server_spec(), ROOT, registry)
    hub.count("order_status", "refused")
    assert registry.get_sample_value("inferline_tool_calls_total", {"tool": "order_status",
                                                                     "outcome": "refused"}) == 1


AGENT = """
name: orders
stages:
  - {id: guard, type: policy, with: {injection: block}}
  - id: answer
    type: agent
    with:
      max_rounds: 3
      tools: [{kind: mcp, server: web, allow: [order_status, poisoned]}]
"""


async def test_the_agent_over_real_mcp_refuses_a_schema_changed_by_a_restarted_server(http_mcp, tmp_path):
    port, process = http_mcp
    spec = server_spec(mcp_port=port)
    hub = ToolHub(spec, ROOT)
    database = make_engine(f"sqlite:///{tmp_path / 'pins.db'}")
    create_schema(database)
    hub.pins = ToolPins(database)  # as a serving process keeps them
    registry = register_builtins(StageRegistry())
    loaded = load_pipeline_text(textwrap.dedent(AGENT), "orders.yaml", registry, catalog_of(spec))

    async def ask(engine, loaded=loaded) -> RequestContext:
        pipeline = Pipeline(loaded, Resources(catalog_of(spec), engines=FakeEngines(smol=engine), audit=Sink(),
                                              tools=hub))
        ctx = RequestContext.from_text("orders", "Where is A-1001?")
        await Runner().run(pipeline, ctx)
        await pipeline.aclose()
        return ctx

    try:
        first = await ask(ScriptedEngine(call("order_status", order_id="A-1001"), "Shipped."))
        assert [r.tool["outcome"] for r in first.stages if r.type == "tool"] == ["ok"]
        engine = ScriptedEngine(call("order_status", order_id="A-1001"), "Shipped.")
        pipeline = Pipeline(loaded, Resources(catalog_of(spec), engines=FakeEngines(smol=engine), audit=Sink(),
                                              tools=hub))
        await pipeline.step("answer").stage._pinned()  # this version pinned the schema it loaded with
        stop(process)
        restarted = start_http_mcp(port, drift=True)
        try:
            ctx = RequestContext.from_text("orders", "Where is A-1001?")
            await Runner().run(pipeline, ctx)
            assert [r.tool["outcome"] for r in ctx.stages if r.type == "tool"] == ["refused"]
            assert "schema drift" in engine.prompts[1]
            poisoned = await ask(ScriptedEngine(call("poisoned", order_id="A-1"), "No."))
            assert [r.tool["outcome"] for r in poisoned.stages if r.type == "tool"] == ["refused"]
            # The version instantiated afresh (a reload, a restart of Inferline): its kept pins still hold, and
            # the drifted tool is not even offered (its new description never reaches the model)...
            again = await ask(afresh := ScriptedEngine(call("order_status", order_id="A-1001"), "Shipped."))
            assert [r.tool["outcome"] for r in again.stages if r.type == "tool"] == ["refused"]
            assert '"order_status"' not in afresh.prompts[0] and '"poisoned"' in afresh.prompts[0]
            assert "no tool 'order_status' is offered" in afresh.prompts[1]
            with database.connect() as conn:
                assert conn.execute(sa.text("SELECT count(*) FROM tool_pins WHERE spec_sha256 = :s"),
                                    {"s": loaded.sha256}).scalar() == 2
            # ...until a new version is deployed, which pins the new definition.
            version_2 = load_pipeline_text(textwrap.dedent(AGENT).replace("name: orders", "name: orders\nversion: '2'"),
                                           "orders.yaml", registry, catalog_of(spec))
            fresh = await ask(ScriptedEngine(call("order_status", order_id="A-1001"), "Shipped."), version_2)
            assert [r.tool["outcome"] for r in fresh.stages if r.type == "tool"] == ["ok"]
        finally:
            stop(restarted)
    finally:
        await hub.aclose()
