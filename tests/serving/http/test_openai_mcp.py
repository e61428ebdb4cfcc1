"""OpenAI's ``{"type": "mcp"}`` tools on the chat and Responses routes (serving/http/openai_mcp.py), run by the
server against the MCP example over stdio: a configured server only (never a client's URL), its allowed tools
only, approval on the Responses API, and the calls in the audit record."""

from __future__ import annotations

import json

import pytest
from openai import BadRequestError, OpenAI

from tests.serving.http.test_approvals import decisions_of
from tests.serving.http.test_approvals import served as served  # the fixture
from tests.stages.test_agent import ScriptedEngine, call

pytestmark = pytest.mark.integration

CHAT = """
name: chat
stages:
  - {id: guard, type: policy, with: {injection: block}}
  - {id: answer, type: llm, with: {model: smol, system: "You are a helpful assistant."}}
  - {id: log, type: audit, always: true, with: {content: full}}
"""
STATUS_ONLY = {"type": "mcp", "server_label": "orders", "allowed_tools": ["order_status"], "require_approval": "never"}


@pytest.fixture
def chat(served, tmp_path):
    (tmp_path / "pipelines" / "chat.yaml").write_text(CHAT)

    def serve(engine: ScriptedEngine):
        client, caller, auditor = served(engine)
        return client, OpenAI(base_url=f"{client.base_url}/v1", api_key=caller, http_client=client), auditor

    return serve


def test_responses_run_an_allowed_tool_of_a_configured_server(chat):
    engine = ScriptedEngine(call("order_status", order_id="A-1001"), "A-1001 shipped on 2026-03-02.")
    client, openai, auditor = chat(engine)
    response = openai.responses.create(model="chat", input="Where is A-1001?", tools=[STATUS_ONLY])
    assert response.output_text == "A-1001 shipped on 2026-03-02."
    assert "order_status" in engine.prompts[0] and "cancel_order" not in engine.prompts[0]
    assert "You are a helpful assistant." in engine.prompts[0]  # the pipeline's system prompt
    assert "shipped on 2026-03-02" in engine.prompts[1]
    assert decisions_of(client, auditor) == [("order_status", "ok", "")]


def test_chat_completions_run_them_too(chat):
    engine = ScriptedEngine(call("cancel_order", order_id="A-1001"), "I cannot cancel orders.")
    _, openai, _ = chat(engine)
    completion = openai.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Cancel A-1001"}],
                                                tools=[STATUS_ONLY])
    assert completion.choices[0].message.content == "I cannot cancel orders."
    assert "no tool 'cancel_order' is offered" in engine.prompts[1]  # outside allowed_tools: never called


def test_responses_pause_for_approval_by_default(chat):
    engine = ScriptedEngine(call("order_status", order_id="A-1001"), "It shipped.")
    client, openai, auditor = chat(engine)
    tools = [{"type": "mcp", "server_label": "orders", "allowed_tools": ["order_status"]}]
    first = openai.responses.create(model="chat", input="Where is A-1001?", tools=tools)
    [item] = first.output
    assert item.type == "mcp_approval_request" and json.loads(item.arguments) == {"order_id": "A-1001"}
    second = openai.responses.create(model="chat", previous_response_id=first.id, tools=tools, input=[
        {"type": "mcp_approval_response", "approval_request_id": item.id, "approve": True}])
    assert second.output_text == "It shipped."
    assert [d[1:] for d in decisions_of(client, auditor)] == [("pending", "pending"), ("ok", "approved")]


@pytest.mark.parametrize(("tool", "message"), [
    ({**STATUS_ONLY, "server_url": "https://evil.example/mcp"}, "never one a request names"),
    ({**STATUS_ONLY, "server_label": "billing"}, "no MCP server 'billing' here"),
    ({"type": "mcp", "server_label": "orders", "require_approval": "never"}, "without a list none is offered"),
    ({**STATUS_ONLY, "require_approval": {"sometimes": {}}}, "require_approval: expected"),
])
def test_a_tool_this_server_does_not_run_is_refused(chat, tool, message):
    _, openai, _ = chat(ScriptedEngine("Hi."))
    with pytest.raises(BadRequestError, match=message):
        openai.responses.create(model="chat", input="Hi", tools=[tool])


def test_chat_completions_cannot_pause_for_approval(chat):
    _, openai, _ = chat(ScriptedEngine("Hi."))
    with pytest.raises(BadRequestError, match="chat completions cannot pause for approval"):
        openai.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Hi"}],
                                       tools=[{**STATUS_ONLY, "require_approval": "always"}])
