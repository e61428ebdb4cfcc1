"""Approval of tool calls (serving/http/approvals.py) over the app, against the MCP example over stdio: the
official ``openai`` client's round trip on the Responses API (an ``mcp_approval_request`` item, then
``previous_response_id`` with an ``mcp_approval_response``), a denied call told to the model as denied, the
pipeline API's ``pending_approval`` and ``resume``, and each decision in the audit record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa
from litestar.testing import TestClient
from openai import BadRequestError, NotFoundError, OpenAI

from pipeline.errors import BackendError
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.engine import make_engine
from store.keys import KeyStore
from store.responses import ResponseStore
from tests.fakes import FakeEngines
from tests.stages.test_agent import ScriptedEngine, call

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
SERVER = """
models:
  smol: {{source: models/smollm2-135m-instruct}}
database: sqlite:///{db}
pipelines: pipelines/
auth: {{enabled: true}}
mcp_servers:
  orders: {{command: [python, {server}]}}
"""
PIPELINE = """
name: orders
stages:
  - id: answer
    type: agent
    with:
      system: "You answer questions about orders."
      tools:
        - {kind: mcp, server: orders, allow: [order_status, cancel_order], require_approval: {tools: [cancel_order]}}
  - {id: log, type: audit, always: true, with: {content: full}}
"""


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A function that serves the ``orders`` pipeline over *engine*: (client, caller key, auditor key)."""
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "orders.yaml").write_text(PIPELINE)
    config = tmp_path / "inferline.yaml"
    config.write_text(SERVER.format(db=tmp_path / "db.sqlite", server=ROOT / "examples" / "mcp_orders" / "server.py"))
    keys = KeyStore(make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    clients = []

    def serve(engine: ScriptedEngine) -> tuple[TestClient, str, str]:
        client = TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=engine)))
        clients.append(client.__enter__())
        return client, keys.create("app", "caller")[1], keys.create("reviewer", "auditor")[1]

    serve.keys = keys  # type: ignore[attr-defined]
    yield serve
    for client in clients:
        client.__exit__(None, None, None)


def decisions_of(client: TestClient, auditor: str) -> list[tuple[str, str, str]]:
    """Each tool call of the audit records, oldest first: (tool, outcome, approval)."""
    auth = {"Authorization": f"Bearer {auditor}"}
    records = client.get("/audit/records", headers=auth).json()["records"]
    calls = []
    for record in sorted(records, key=lambda r: r["seq"]):
        stages = client.get(f"/audit/records/{record['id']}", headers=auth).json()["stages"]
        calls += [(s["step"]["tool"]["tool"], s["step"]["tool"]["outcome"], s["step"]["tool"].get("approval", ""))
                  for s in stages if s["type"] == "tool"]
    return calls


@pytest.mark.parametrize("approve", [True, False])
def test_the_openai_client_approves_or_denies_a_call_and_the_response_goes_on(served, approve):
    engine = ScriptedEngine(call("cancel_order", order_id="A-1002"), "Done: A-1002 is cancelled."
                            if approve else "I did not cancel A-1002.")
    client, caller, auditor = served(engine)
    openai = OpenAI(base_url=f"{client.base_url}/v1", api_key=caller, http_client=client)

    first = openai.responses.create(model="orders", input="Cancel A-1002.")
    [item] = first.output
    assert item.type == "mcp_approval_request"
    assert (item.name, item.server_label, json.loads(item.arguments)) == ("cancel_order", "orders",
                                                                          {"order_id": "A-1002"})
    assert first.output_text == "" and len(engine.prompts) == 1

    second = openai.responses.create(model="orders", previous_response_id=first.id, input=[
        {"type": "mcp_approval_response", "approval_request_id": item.id, "approve": approve}])
    assert second.output_text == ("Done: A-1002 is cancelled." if approve else "I did not cancel A-1002.")
    told = engine.prompts[1]
    if approve:
        assert "order A-1002 cancelled" in told
    else:
        assert '"outcome": "denied"' in told and "order A-1002 cancelled" not in told
    assert decisions_of(client, auditor) == [
        ("cancel_order", "pending", "pending"),
        ("cancel_order", "ok", "approved") if approve else ("cancel_order", "denied", "denied")]

    with pytest.raises(NotFoundError, match="awaits approval"):  # a request resumes once
        openai.responses.create(model="orders", previous_response_id=first.id, input=[
            {"type": "mcp_approval_response", "approval_request_id": item.id, "approve": True}])


def test_a_call_that_needs_no_approval_runs_at_once(served):
    client, caller, _ = served(ScriptedEngine(call("order_status", order_id="A-1001"), "It shipped."))
    openai = OpenAI(base_url=f"{client.base_url}/v1", api_key=caller, http_client=client)
    assert openai.responses.create(model="orders", input="Where is A-1001?").output_text == "It shipped."


def test_an_approval_names_a_call_the_response_awaits(served):
    client, caller, _ = served(ScriptedEngine(call("cancel_order", order_id="A-1002"), "Cancelled."))
    openai = OpenAI(base_url=f"{client.base_url}/v1", api_key=caller, http_client=client)
    first = openai.responses.create(model="orders", input="Cancel A-1002.")
    with pytest.raises(BadRequestError, match="not a call request"):
        openai.responses.create(model="orders", previous_response_id=first.id, input=[
            {"type": "mcp_approval_response", "approval_request_id": "mcpr_other", "approve": True}])
    second = openai.responses.create(model="orders", previous_response_id=first.id, input=[  # still awaiting
        {"type": "mcp_approval_response", "approval_request_id": first.output[0].id, "approve": True}])
    assert second.output_text == "Cancelled."


def test_the_pipeline_api_pauses_with_pending_approval_and_resumes(served):
    client, caller, auditor = served(ScriptedEngine(call("cancel_order", order_id="A-1002"), "Cancelled it."))
    auth = {"Authorization": f"Bearer {caller}"}
    paused = client.post("/pipelines/orders", json={"input": "Cancel A-1002."}, headers=auth).json()
    assert paused["finish_reason"] == "approval_required" and paused["output"] == ""
    [pending] = paused["pending_approval"]
    assert (pending["name"], pending["server_label"], json.loads(pending["arguments"])) == (
        "cancel_order", "orders", {"order_id": "A-1002"})

    other = {"Authorization": f"Bearer {served.keys.create('other', 'caller')[1]}"}
    stolen = client.post("/pipelines/orders", headers=other, json={"resume": paused["request_id"], "approvals": []})
    assert stolen.status_code == 404  # another key's paused request does not exist for it
    resumed = client.post("/pipelines/orders", headers=auth, json={
        "resume": paused["request_id"], "approvals": [{"id": pending["id"], "approve": True}]})
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["output"] == "Cancelled it." and "pending_approval" not in resumed.json()
    assert decisions_of(client, auditor)[-1] == ("cancel_order", "ok", "approved")
    again = client.post("/pipelines/orders", headers=auth, json={"resume": paused["request_id"], "approvals": []})
    assert again.status_code == 404 and "awaits approval" in again.json()["detail"]


def test_a_streamed_response_ends_with_its_approval_requests(served):
    client, caller, _ = served(ScriptedEngine(call("cancel_order", order_id="A-1002"), "Cancelled."))
    openai = OpenAI(base_url=f"{client.base_url}/v1", api_key=caller, http_client=client)
    events = list(openai.responses.create(model="orders", input="Cancel A-1002.", stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.output_item.done", "response.completed"]
    [item] = events[-1].response.output
    assert item.type == "mcp_approval_request" and item.name == "cancel_order"
    second = openai.responses.create(model="orders", previous_response_id=events[-1].response.id, input=[
        {"type": "mcp_approval_response", "approval_request_id": item.id, "approve": True}])
    assert second.output_text == "Cancelled."


def test_a_streamed_pipeline_request_says_what_it_awaits_in_its_done_event(served):
    client, caller, _ = served(ScriptedEngine(call("cancel_order", order_id="A-1002"), "Cancelled."))
    auth = {"Authorization": f"Bearer {caller}"}
    with client.stream("POST", "/pipelines/orders", json={"input": "Cancel A-1002.", "stream": True},
                       headers=auth) as response:
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    done = json.loads(events[-1].removeprefix("data:"))
    [pending] = done["pending_approval"]
    resumed = client.post("/pipelines/orders", headers=auth, json={
        "resume": done["request_id"], "approvals": [{"id": pending["id"], "approve": False}]})
    assert resumed.json()["output"] == "Cancelled."  # what the scripted model says, told it was denied


def test_a_pause_that_cannot_be_kept_fails_the_request_and_its_record_says_so(served, monkeypatch):
    def away(self, paused):
        raise sa.exc.OperationalError("INSERT", {}, Exception("the database is away"))

    monkeypatch.setattr(ResponseStore, "pause", away)
    client, caller, auditor = served(ScriptedEngine(call("cancel_order", order_id="A-1002"), "Cancelled it."))
    response = client.post("/pipelines/orders", json={"input": "Cancel A-1002."},
                           headers={"Authorization": f"Bearer {caller}"})
    assert response.status_code == 503 and "could not be stored" in response.json()["detail"]
    [record] = client.get("/audit/records", headers={"Authorization": f"Bearer {auditor}"}).json()["records"]
    assert record["status"] == "failed" and record["http_status"] == 503
    assert decisions_of(client, auditor) == [("cancel_order", "pending", "pending")]


def test_a_request_resumes_only_where_a_step_of_that_id_can_pause(served):
    client, caller, _ = served(ScriptedEngine(call("cancel_order", order_id="A-1002"), "Cancelled."))
    openai = OpenAI(base_url=f"{client.base_url}/v1", api_key=caller, http_client=client)
    tools = [{"type": "mcp", "server_label": "orders", "allowed_tools": ["cancel_order"]}]
    first = openai.responses.create(model="orders", input="Cancel A-1002.", tools=tools)  # paused at mcp_tools
    asked = first.output[-1].id
    auth = {"Authorization": f"Bearer {caller}"}
    conflict = client.post("/pipelines/orders", headers=auth, json={
        "resume": first.id.removeprefix("resp_"), "approvals": [{"id": asked, "approve": True}]})
    assert conflict.status_code == 409 and "no longer has the agent step 'mcp_tools'" in conflict.json()["detail"]
    second = openai.responses.create(model="orders", previous_response_id=first.id, tools=tools, input=[
        {"type": "mcp_approval_response", "approval_request_id": asked, "approve": True}])
    assert second.output_text == "Cancelled."  # the conflict left it paused


DRAFTED = """
name: drafted
stages:
  - {id: draft, type: llm, with: {system: "Restate the request."}}
  - id: answer
    type: agent
    with:
      user: "{{ steps.draft.output }}"
      tools: [{kind: mcp, server: orders, allow: [cancel_order], require_approval: always}]
  - {id: log, type: audit, always: true, with: {content: full}}
"""


def test_a_resumed_request_reuses_the_steps_before_the_pause(served, tmp_path):
    (tmp_path / "pipelines" / "drafted.yaml").write_text(DRAFTED)
    engine = ScriptedEngine("Cancel order A-1002.", call("cancel_order", order_id="A-1002"), "Cancelled.")
    client, caller, auditor = served(engine)
    auth = {"Authorization": f"Bearer {caller}"}
    paused = client.post("/pipelines/drafted", json={"input": "pls cancel A-1002"}, headers=auth).json()
    [pending] = paused["pending_approval"]
    resumed = client.post("/pipelines/drafted", headers=auth, json={
        "resume": paused["request_id"], "approvals": [{"id": pending["id"], "approve": True}]})
    assert resumed.json()["output"] == "Cancelled."
    assert len(engine.prompts) == 3  # the draft was made once: the resumed request reused it
    records = client.get("/audit/records", headers={"Authorization": f"Bearer {auditor}"}).json()["records"]
    latest = max(records, key=lambda r: r["seq"])
    stages = client.get(f"/audit/records/{latest['id']}", headers={"Authorization": f"Bearer {auditor}"}).json()
    draft = next(s for s in stages["stages"] if s["stage_id"] == "draft")
    assert draft["step"]["reused"] is True


FAILS_AFTER = """
name: fails_after
stages:
  - id: answer
    type: agent
    with:
      tools: [{kind: mcp, server: orders, allow: [cancel_order], require_approval: always}]
  - {id: note, type: llm, always: true, with: {system: "Note it."}}
  - {id: log, type: audit, always: true, with: {content: full}}
"""


class FailsSecond(ScriptedEngine):
    """Proposes a call, then fails: the step after the pause fails the request."""

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        if self.prompts:
            raise BackendError("the model went away")
        return await super().submit(prompt_ids, sampling, cache_salt, hints=hints)


def test_a_request_that_fails_after_its_pause_leaves_nothing_to_resume(served, tmp_path):
    (tmp_path / "pipelines" / "fails_after.yaml").write_text(FAILS_AFTER)
    client, caller, _ = served(FailsSecond(call("cancel_order", order_id="A-1002")))
    auth = {"Authorization": f"Bearer {caller}"}
    failed = client.post("/pipelines/fails_after", json={"input": "Cancel A-1002."}, headers=auth)
    assert failed.status_code == 503, failed.text
    request_id = failed.headers["x-request-id"]
    resumed = client.post("/pipelines/fails_after", headers=auth, json={"resume": request_id, "approvals": []})
    assert resumed.status_code == 404 and "awaits approval" in resumed.json()["detail"]
