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
    listed, made, message = response.output  # what the tools did, as OpenAI's items, before the message
    assert (listed.type, listed.server_label, [t.name for t in listed.tools]) == (
        "mcp_list_tools", "orders", ["order_status"])
    assert listed.tools[0].input_schema["required"] == ["order_id"]
    assert (made.type, made.name, made.server_label, json.loads(made.arguments), made.error, made.status) == (
        "mcp_call", "order_status", "orders", {"order_id": "A-1001"}, None, "completed")
    assert "shipped on 2026-03-02" in made.output and message.type == "message"
    again = openai.responses.create(model="chat", previous_response_id=response.id, tools=[STATUS_ONLY],
                                    input="Thanks!")  # the items stored with it are taken back, not read
    assert again.output_text == "A-1001 shipped on 2026-03-02."  # the script's last reply, again


def test_a_streamed_response_shows_its_mcp_items_before_the_answer(chat):
    engine = ScriptedEngine(call("order_status", order="A-9999"), "No such order.")  # refused: no order_id
    _, openai, _ = chat(engine)
    events = list(openai.responses.create(model="chat", input="Where is A-9999?", tools=[STATUS_ONLY], stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:9] == ["response.output_item.added", "response.mcp_list_tools.completed",
                          "response.output_item.done", "response.output_item.added",
                          "response.mcp_call_arguments.done", "response.mcp_call.failed", "response.output_item.done"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    final = events[-1].response
    assert [item.type for item in final.output] == ["mcp_list_tools", "mcp_call", "message"]
    failed = final.output[1]
    assert failed.status == "failed" and failed.output is None and "order_id" in failed.error.content[0]["text"]
    assert final.output_text == "No such order."
    text_event = next(e for e in events if e.type == "response.output_text.delta")
    assert text_event.output_index == 2


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
    listed, item = first.output
    assert listed.type == "mcp_list_tools"
    assert item.type == "mcp_approval_request" and json.loads(item.arguments) == {"order_id": "A-1001"}
    second = openai.responses.create(model="chat", previous_response_id=first.id, tools=tools, input=[
        {"type": "mcp_approval_response", "approval_request_id": item.id, "approve": True}])
    assert second.output_text == "It shipped."
    made, _ = second.output  # listed by the first response, not again
    assert made.type == "mcp_call" and made.approval_request_id == item.id and made.status == "completed"
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


def test_a_streamed_pause_sends_its_approval_request_after_the_mcp_items(chat):
    _, openai, _ = chat(ScriptedEngine(call("order_status", order_id="A-1001"), "It shipped."))
    tools = [{"type": "mcp", "server_label": "orders", "allowed_tools": ["order_status"]}]
    events = list(openai.responses.create(model="chat", input="Where is A-1001?", tools=tools, stream=True))
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "mcp_list_tools"), (1, "mcp_approval_request")]
    assert [item.type for item in events[-1].response.output] == ["mcp_list_tools", "mcp_approval_request"]
