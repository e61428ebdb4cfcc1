"""Inferline as an MCP server (serving/http/mcp_routes.py): the official ``mcp`` client against a real server
on loopback, auth on, with keys of each role."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from serving.http.mcp_routes import NO_TOOLS
from serving.runtime.pipeline_tool import TOOL_ARGUMENTS
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.engine import make_engine
from store.keys import KeyStore
from tests.serving.live_server import LiveServer
from tests.serving.workspaces import write_workspace

pytestmark = pytest.mark.integration

#: Only an admin may call it (a caller's tools do not show it), and callers may set max_tokens only.
ADMIN_ONLY = """
name: ops
description: Operators' own pipeline.
access: {roles: [admin]}
stages:
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 16, client_params: [max_tokens]}}
  - {id: out, type: stream}
"""
#: One request a minute, and an audit stage: the second call is refused by the policy stage, and audited.
LIMITED = """
name: limited
description: Answers once a minute.
access: {roles: [caller]}
stages:
  - {id: guard, type: policy, with: {limits: {requests_per_minute: 1}}}
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 16}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true}
"""
DEPLOYED = """
name: faq
description: Answers frequently asked questions.
access: {roles: [caller]}
stages:
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 16}}
  - {id: out, type: stream}
"""
#: A handshake-era client's first message, and the media types every MCP POST accepts.
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}}}
ACCEPT = {"Accept": "application/json, text/event-stream"}


@dataclass
class Served:
    url: str
    keys: dict[str, str]
    ids: dict[str, str]

    def auth(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"}

    @asynccontextmanager
    async def client(self, role: str | None, **options: object) -> AsyncIterator[Client]:
        """The official client on ``/mcp`` with *role*'s key (None: no key)."""
        headers = self.auth(role) if role else {}
        async with httpx2.AsyncClient(headers=headers) as http, \
                Client(streamable_http_client(f"{self.url}/mcp", http_client=http), **options) as client:
            yield client

    def records(self, **filters: str) -> list[dict]:
        response = httpx.get(f"{self.url}/audit/records", params={"limit": "100", **filters},
                             headers=self.auth("auditor"))
        assert response.status_code == 200, response.text
        return response.json()["records"]


@pytest.fixture
def served(tmp_path, monkeypatch, fake_engines):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=True)
    pipelines = tmp_path / "pipelines"
    (pipelines / "reviews.yaml").unlink()  # the auditor's pipeline: without it, an auditor may call none
    (pipelines / "ops.yaml").write_text(textwrap.dedent(ADMIN_ONLY))
    (pipelines / "limited.yaml").write_text(textwrap.dedent(LIMITED))
    store = KeyStore(make_engine(f"sqlite:///{tmp_path / 'keys.db'}"))
    server = LiveServer(create_server(open_workspace(str(config)), engines=fake_engines))
    try:
        keys, ids = {}, {}
        for role in ("caller", "auditor", "admin"):
            info, keys[role] = store.create(f"the {role}", role)
            ids[role] = info.id
        yield Served(server.url, keys, ids)
    finally:
        server.stop()


async def test_a_caller_lists_the_pipelines_it_may_call(served):
    async with served.client("caller") as client:
        listed = await client.list_tools()
    assert [tool.name for tool in listed.tools] == ["chat", "limited"]  # not ops: admins only
    chat = listed.tools[0]
    assert chat.description == "Chat."
    schema = chat.input_schema
    assert (schema["type"], schema["required"], schema["additionalProperties"]) == ("object", ["input"], False)
    assert schema == TOOL_ARGUMENTS  # its generate stage lets callers set every sampling option (the default)
    assert "stream" not in schema["properties"]  # a tool's result comes whole


async def test_an_admin_lists_every_pipeline(served):
    async with served.client("admin") as client:
        listed = await client.list_tools()
    assert [tool.name for tool in listed.tools] == ["chat", "limited", "ops"]
    # Only the sampling options the pipeline lets callers set (its generate stage's client_params).
    assert set(listed.tools[2].input_schema["properties"]) == {"input", "tags", "max_tokens"}


async def test_an_option_the_pipeline_refuses_is_refused_as_on_the_http_route(served):
    async with served.client("admin") as client:
        result = await client.call_tool("ops", {"input": "hi", "top_k": 5})
    assert result.is_error and result.structured_content["status"] == 400
    assert "does not let callers set ['top_k']" in result.content[0].text


async def test_a_key_that_may_call_nothing_is_told_so(served):
    async with served.client("auditor") as client:
        with pytest.raises(MCPError) as raised:
            await client.list_tools()
    assert raised.value.error.code == NO_TOOLS
    assert f"API key {served.ids['auditor']} (role 'auditor') may call no served pipeline" in str(raised.value)


async def test_a_call_runs_the_pipeline_and_is_audited(served):
    async with served.client("caller") as client:
        result = await client.call_tool("chat", {"input": "What is the capital of France?", "max_tokens": 8,
                                                 "tags": {"team": "support"}})
    assert not result.is_error
    assert result.content[0].text == result.structured_content["output"]
    assert result.structured_content["output"].startswith("Paris")
    request_id = result.structured_content["request_id"]
    record = next(r for r in served.records(pipeline="chat") if r["request_id"] == request_id)
    assert (record["status"], record["key_id"], record["role"]) == ("ok", served.ids["caller"], "caller")
    assert record["input_content"] == "What is the capital of France?"  # the chat pipeline keeps content in full


async def test_refusals_are_errors_and_audited_as_on_the_http_route(served):
    async with served.client("caller") as client:
        forbidden = await client.call_tool("ops", {"input": "hi"})
        first = await client.call_tool("limited", {"input": "hi"})
        limited = await client.call_tool("limited", {"input": "hi"})
        unknown = await client.call_tool("nope", {"input": "hi"})
        malformed = await client.call_tool("chat", {"prompt": "hi"})
    assert forbidden.is_error and forbidden.structured_content["status"] == 403
    assert "role 'caller' may not call pipeline 'ops'" in forbidden.content[0].text
    assert not first.is_error
    assert limited.is_error and limited.structured_content["status"] == 429
    assert unknown.is_error and unknown.structured_content["status"] == 404
    assert malformed.is_error and malformed.structured_content["status"] == 422
    assert "input: Field required" in malformed.content[0].text
    refused = served.records(pipeline="ops", status="denied")
    assert [(r["http_status"], r["error_type"], r["key_id"]) for r in refused] == [
        (403, "role_not_allowed", served.ids["caller"])]
    assert refused[0]["policy"][0]["route"] == "/mcp"
    assert [r["status"] for r in served.records(pipeline="limited")] == ["denied", "ok"]  # newest first


@pytest.mark.parametrize("headers, code", [({}, "missing_key"),
                                           ({"Authorization": "Bearer not-a-key"}, "invalid_key")])
def test_without_a_valid_key_it_is_a_401_like_every_route(served, headers, code):
    response = httpx.post(f"{served.url}/mcp", json=INITIALIZE, headers={**headers, **ACCEPT})
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["www-authenticate"].startswith("Bearer")
    record = next(r for r in served.records(status="denied") if r["error_type"] == code)
    assert (record["http_status"], record["key_id"], record["policy"][0]["route"]) == (401, None, "/mcp")


async def test_the_official_client_without_a_key_gets_no_session(served):
    statuses = []

    async def seen(response: httpx2.Response) -> None:
        statuses.append(response.status_code)

    async with httpx2.AsyncClient(event_hooks={"response": [seen]}) as http:
        with pytest.raises(BaseExceptionGroup) as raised:
            async with Client(streamable_http_client(f"{served.url}/mcp", http_client=http)) as client:
                await client.list_tools()
    assert raised.group_contains(MCPError)
    assert statuses and set(statuses) == {401}


def test_a_session_answers_only_the_key_that_opened_it(served):
    opened = httpx.post(f"{served.url}/mcp", json=INITIALIZE, headers={**served.auth("caller"), **ACCEPT})
    assert opened.status_code == 200, opened.text
    session = {"mcp-session-id": opened.headers["mcp-session-id"], "mcp-protocol-version": "2025-06-18"}
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    reused = httpx.post(f"{served.url}/mcp", json=listing, headers={**served.auth("admin"), **ACCEPT, **session})
    assert reused.status_code == 404  # as if it did not exist


async def deploy(served: Served, name: str, text: str) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{served.url}/pipelines/{name}/versions", json={"yaml": textwrap.dedent(text)},
                                   headers=served.auth("admin"))
    assert response.status_code == 201, response.text


async def test_a_deploy_and_a_retirement_tell_a_listening_session_that_the_tools_changed(served):
    async with served.client("caller") as client:
        before = await tool_names(client)
        async with client.listen(tools_list_changed=True) as events:
            await deploy(served, "faq", DEPLOYED)
            with anyio.fail_after(10):
                await anext(aiter(events))
            deployed = await tool_names(client)
            async with httpx.AsyncClient() as http:
                retired = await http.delete(f"{served.url}/pipelines/faq", headers=served.auth("admin"))
            assert retired.status_code == 200, retired.text
            with anyio.fail_after(10):
                await anext(aiter(events))
            after = await tool_names(client)
    assert (deployed - before, after) == ({"faq"}, before)


async def tool_names(client: Client) -> set[str]:
    return {tool.name for tool in (await client.list_tools()).tools}


async def test_a_deploy_tells_a_handshake_era_session_on_its_stream(served):
    changed = anyio.Event()

    async def on_message(message: object) -> None:
        if getattr(message, "method", None) == "notifications/tools/list_changed":
            changed.set()

    async with served.client("caller", mode="legacy", message_handler=on_message) as client:
        assert client.server_capabilities.tools.list_changed
        await client.list_tools()
        await deploy(served, "faq", DEPLOYED)
        with anyio.fail_after(10):
            await changed.wait()
        assert "faq" in await tool_names(client)


def test_without_auth_a_loopback_client_needs_no_key(tmp_path, monkeypatch, fake_engines):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    server = LiveServer(create_server(open_workspace(str(write_workspace(tmp_path, auth=False))),
                                      engines=fake_engines))
    try:
        async def listed() -> set[str]:
            async with Client(f"{server.url}/mcp") as client:
                return await tool_names(client)

        assert anyio.run(listed) == {"chat", "reviews"}
        # A page that rebound a name of its own to 127.0.0.1 is not answered (DNS rebinding).
        rebound = httpx.post(f"{server.url}/mcp", json=INITIALIZE, headers={**ACCEPT, "Host": "evil.example"})
        assert rebound.status_code == 421
    finally:
        server.stop()


async def test_a_body_sent_in_chunks_past_the_limit_is_a_413_and_one_under_it_is_handed_on_whole():
    from serving.http.mcp_server import McpSessions
    from serving.http.problems import Problem

    def chunks(*parts: bytes):
        messages = [{"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
                    for i, part in enumerate(parts)] + [{"type": "http.disconnect"}]

        async def receive():
            return messages.pop(0)
        return receive

    sessions = McpSessions.__new__(McpSessions)
    sessions.max_body_bytes = 10
    scope = {"type": "http", "method": "POST", "headers": [], "path": "/mcp"}  # no content-length: chunked
    with pytest.raises(Problem) as caught:
        await sessions._bounded(scope, chunks(b"123456", b"78901"))
    assert caught.value.status == 413 and "http.max_body_bytes (10 bytes)" in caught.value.detail
    receive = await sessions._bounded(scope, chunks(b"12345", b"6789"))
    assert await receive() == {"type": "http.request", "body": b"123456789", "more_body": False}
    assert await receive() == {"type": "http.disconnect"}
