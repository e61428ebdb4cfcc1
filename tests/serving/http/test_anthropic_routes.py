"""Anthropic's Messages API (serving/http/anthropic_routes.py): over fake engines (what reaches the engine,
the answer's shape, the stream's events, refusals and errors), then the official ``anthropic`` package
against a real server process over HTTP on the real model, with auth on (``x-api-key``) and off."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import Overloaded
from stages import tools
from tests import fakes
from tests.serving import workspaces as serving

WEATHER = {"name": "get_weather", "description": "Current weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ASK = [{"role": "user", "content": "What is the capital of France?"}]
REPLY = "Paris is the capital of France."


def create(client, headers=None, **body):
    return client.post("/v1/messages", json={"model": "chat", "max_tokens": 64, "messages": ASK, **body},
                       headers=headers)


def submitted(fake_engines):
    """The prompt (the fake tokenizer's bytes) and sampling of the last request the engine got."""
    prompt, sampling = fake_engines.engines["smol"].submitted[-1][:2]
    return bytes(prompt).decode(), sampling


def reply(fake_engines, text: str) -> None:
    fake_engines.engines["smol"].reply = text.encode()


def events(response) -> list[tuple[str, dict]]:
    """The stream's (event, data) pairs."""
    found = []
    for chunk in response.text.split("\r\n\r\n"):
        if chunk.strip():
            event, data = chunk.split("\r\n")
            found.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return found


def assert_anthropic_error(response, status: int, error_type: str, needle: str = "") -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == error_type, body
    assert needle in body["error"]["message"], body


# -- the answer ---------------------------------------------------------------------------------


def test_a_message(client, fake_engines):
    response = create(client)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("msg_") and body["type"] == "message" and body["role"] == "assistant"
    assert body["model"] == "chat"
    assert body["content"] == [{"type": "text", "text": REPLY}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    prompt, sampling = submitted(fake_engines)
    assert body["usage"] == {"input_tokens": len(prompt.encode()), "output_tokens": len(REPLY.encode())}
    assert sampling.max_tokens == 64
    assert response.headers["request-id"] == response.headers["x-request-id"]


def test_system_and_turns_reach_the_prompt(client, fake_engines):
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
                {"role": "user", "content": [{"type": "text", "text": "Capital"},
                                             {"type": "text", "text": "of France?"}]}]
    response = create(client, system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                      messages=messages, temperature=0.5, top_p=0.9, top_k=5)
    assert response.status_code == 200, response.text
    prompt, sampling = submitted(fake_engines)
    assert prompt.index("Be brief.") < prompt.index("Hi") < prompt.index("Hello!") < prompt.index("Capital\nof France?")
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.9, 5)


def test_stop_sequences_end_the_reply(client):
    body = create(client, stop_sequences=["nope", " capital"]).json()
    assert body["content"][0]["text"] == "Paris is the"
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", " capital")


def test_max_tokens_cuts_the_reply(client):
    body = create(client, max_tokens=5).json()
    assert body["content"][0]["text"] == "Paris"
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 5


@pytest.fixture
def tagged_client(tmp_path, monkeypatch, fake_engines):
    """The app whose chat pipeline's system prompt names the request's user tag."""
    monkeypatch.setattr(serving, "CHAT", serving.CHAT.replace(
        "{id: prompt, type: prompt}", "{id: prompt, type: prompt, with: {system: 'User {{ tags.user }}.'}}"))
    with serving.client_for(tmp_path, monkeypatch, fake_engines, auth=False) as test_client:
        yield test_client


def test_metadata_user_id_is_the_user_tag(tagged_client, fake_engines):
    assert create(tagged_client, metadata={"user_id": "u-42"}).status_code == 200
    assert "User u-42." in submitted(fake_engines)[0]


def test_a_message_is_audited_as_every_pipeline_call(client):
    usage = create(client, metadata={"user_id": "u-42"}).json()["usage"]
    (record,) = client.get("/audit/records", params={"pipeline": "chat"}).json()["records"]
    assert (record["status"], record["input_tokens"], record["output_tokens"]) == (
        "ok", usage["input_tokens"], usage["output_tokens"])


@pytest.fixture
def limited_client(tmp_path, monkeypatch, fake_engines, fresh_minute):
    """The app whose chat pipeline takes two requests a minute."""
    monkeypatch.setattr(serving, "CHAT", serving.CHAT.replace(
        "stages:\n", "stages:\n  - {id: guard, type: policy, with: {limits: {requests_per_minute: 2}}}\n"))
    with serving.client_for(tmp_path, monkeypatch, fake_engines, auth=False) as test_client:
        yield test_client


def test_rate_limits_count_messages(limited_client):
    first = create(limited_client)
    assert first.status_code == 200 and first.headers["x-ratelimit-remaining-requests"] == "1"
    assert create(limited_client, stream=True).headers["x-ratelimit-remaining-requests"] == "0"
    for stream in (False, True):
        refused = create(limited_client, stream=stream)
        assert_anthropic_error(refused, 429, "rate_limit_error")
        assert int(refused.headers["retry-after"]) > 0
    counted = limited_client.post("/v1/messages/count_tokens", json={"model": "chat", "messages": ASK})
    assert counted.status_code == 200  # a count runs no stage: no limit counts it


# -- tools ----------------------------------------------------------------------------------------


def test_a_forced_tool_use(client, fake_engines):
    reply(fake_engines, CALL)
    body = create(client, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}).json()
    _, sampling = submitted(fake_engines)
    openai_tool = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                    "parameters": WEATHER["input_schema"]}}
    assert sampling.output == {"json_schema": tools.call_schema([openai_tool], ["get_weather"])}
    (block,) = body["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    assert (block["name"], block["input"]) == ("get_weather", {"city": "Paris"})
    assert body["stop_reason"] == "tool_use"


def test_auto_returns_text_that_is_not_a_call(client, fake_engines):
    body = create(client, tools=[WEATHER]).json()
    assert body["content"] == [{"type": "text", "text": REPLY}] and body["stop_reason"] == "end_turn"
    assert submitted(fake_engines)[1].output is None


def test_a_forced_call_cut_by_max_tokens_has_no_content(client, fake_engines):
    reply(fake_engines, CALL)
    body = create(client, max_tokens=4, tools=[WEATHER], tool_choice={"type": "any"}).json()
    assert body["content"] == [] and body["stop_reason"] == "max_tokens"


def test_tool_results_in_the_history(client, fake_engines):
    messages = [*ASK, {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": '{"temp_c": 21}'}]},
                                     {"type": "text", "text": "And so?"}]}]
    assert create(client, messages=messages, tools=[WEATHER]).status_code == 200
    prompt, _ = submitted(fake_engines)
    assert 'Let me look.\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>\nAnd so?' in prompt


def sdk_reply(caller: dict | None = None) -> list[dict]:
    """An assistant reply as the ``anthropic`` package gives it back: its own blocks' ``model_dump()``."""
    from anthropic.types import TextBlock, ToolUseBlock

    call = ToolUseBlock.model_validate({"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                        "input": {"city": "Paris"}, "caller": caller})
    return [TextBlock(type="text", text="Let me look.").model_dump(), call.model_dump()]


@pytest.mark.parametrize("caller", [None, {"type": "direct"}])
def test_a_reply_resent_as_the_sdk_dumps_it_is_taken(client, fake_engines, caller):
    reply_blocks = sdk_reply(caller)
    assert {"caller", "toolset_name"} <= set(reply_blocks[1]) and "citations" in reply_blocks[0]  # what it dumps
    messages = [*ASK, {"role": "assistant", "content": reply_blocks},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"}]}]
    response = create(client, messages=messages, tools=[WEATHER])
    assert response.status_code == 200, response.text
    prompt, _ = submitted(fake_engines)
    assert 'Let me look.\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt


@pytest.mark.parametrize(("change", "needle"), [
    ({"caller": {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"}}, 'server tool "code_execution_20250825"'),
    ({"toolset_name": "mcp"}, "toolset_name: Value error, toolsets are not supported"),
])
def test_what_the_sdk_dumps_but_we_do_not_do_is_refused_by_name(client, fake_engines, change, needle):
    text, call = sdk_reply()
    messages = [*ASK, {"role": "assistant", "content": [text, {**call, **change}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"}]}]
    assert_anthropic_error(create(client, messages=messages, tools=[WEATHER]), 400, "invalid_request_error", needle)
    cited = [*ASK, {"role": "assistant", "content": [{**text, "citations": [{"type": "char_location"}]}]}, *ASK]
    assert_anthropic_error(create(client, messages=cited), 400, "invalid_request_error", "citations are not supported")
    assert not fake_engines.engines["smol"].submitted


# -- streaming --------------------------------------------------------------------------------------


def test_the_stream(client):
    response = create(client, stream=True, stop_sequences=[" of"])
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    found = events(response)
    names = [name for name, _ in found]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in found)
    start = found[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    text = "".join(data["delta"]["text"] for name, data in found if name == "content_block_delta")
    assert text == "Paris is the capital"
    delta = found[-2][1]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " of"}
    whole = create(client, stop_sequences=[" of"]).json()
    assert text == whole["content"][0]["text"] and delta["usage"] == whole["usage"]
    assert start["usage"]["input_tokens"] == whole["usage"]["input_tokens"]


def test_a_streamed_tool_use(client, fake_engines):
    reply(fake_engines, CALL)
    found = events(create(client, stream=True, tools=[WEATHER], tool_choice={"type": "any"}))
    assert [name for name, _ in found] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                          "content_block_stop", "message_delta", "message_stop"]
    block = found[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    assert json.loads(found[3][1]["delta"]["partial_json"]) == {"city": "Paris"}
    assert found[5][1]["delta"]["stop_reason"] == "tool_use"


def test_streamed_text_with_tools_offered(client):
    found = events(create(client, stream=True, tools=[WEATHER]))
    text = "".join(data["delta"]["text"] for name, data in found if name == "content_block_delta")
    assert text == REPLY and found[-2][1]["delta"]["stop_reason"] == "end_turn"


def test_an_error_once_the_stream_started_is_an_error_event(client, fake_engines, monkeypatch):
    class Breaking(fakes.FakeStream):
        async def _events(self):
            async for event in super()._events():
                yield event
                if self.sent == 5:
                    raise RuntimeError("the engine broke")

    monkeypatch.setattr(fakes, "FakeStream", Breaking)
    response = create(client, stream=True)
    assert response.status_code == 200
    found = events(response)
    assert [name for name, _ in found][:3] == ["message_start", "ping", "content_block_start"]
    assert "".join(data["delta"]["text"] for name, data in found if name == "content_block_delta") == "Paris"
    name, data = found[-1]
    assert name == "error" and data["type"] == "error" and data["error"]["type"] == "api_error", data
    assert "message_stop" not in [name for name, _ in found]


@pytest.mark.parametrize("stream", [False, True])
def test_an_overloaded_engine_is_anthropics_429(client, fake_engines, stream):
    async def overloaded(prompt_ids, sampling, cache_salt="", *, hints=None):
        raise Overloaded("queue full", retry_after_s=2.0)

    fake_engines.engines["smol"].submit = overloaded
    response = create(client, stream=stream)
    assert_anthropic_error(response, 429, "rate_limit_error", "queue full")
    assert response.headers["retry-after"] == "2"


# -- count_tokens -------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"system": "Be brief."}, {"tools": [WEATHER], "tool_choice": {"type": "any"}}])
def test_count_tokens_is_the_prompt_the_model_gets(client, fake_engines, extra):
    if "tools" in extra:
        reply(fake_engines, CALL)
    counted = client.post("/v1/messages/count_tokens", json={"model": "chat", "messages": ASK, **extra})
    assert counted.status_code == 200, counted.text
    assert counted.json() == {"input_tokens": create(client, **extra).json()["usage"]["input_tokens"]}


# -- refusals and errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "needle"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking: not supported"),
    ({"service_tier": "auto", "frobnicate": 1}, "frobnicate, service_tier: not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     'messages[0].content[0].type: "image" blocks are not supported'),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, '"document" blocks'),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"tools": [{**WEATHER, "strict": True}]}, "tools[0].strict"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
    ({"tools": [WEATHER, WEATHER]}, "tool names must be unique"),
    ({"tool_choice": {"type": "any"}}, "tool_choice: may only be specified while providing tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "no tool 'nope'"),
    ({"messages": [{"role": "assistant", "content": "Hi"}, *ASK]}, 'first message must use the "user" role'),
    ({"messages": [*ASK, {"role": "assistant", "content": "The capital is"}]}, "prefill"),
    ({"messages": [{"role": "user", "content": ""}]}, "non-empty content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}],
      "tools": [WEATHER]}, "unexpected tool_use_id 'toolu_9'"),
    ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                            "input": {}}]}, {"role": "user", "content": "well?"}],
      "tools": [WEATHER]}, "tool_use ids were found without tool_result blocks immediately after: toolu_1"),
    ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                            "input": {}}]}, {"role": "user", "content": "well?"}]},
     "must define tools"),
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 100_000}, "max_tokens"),  # over the pipeline's own limit
])
def test_what_we_cannot_do_is_refused_by_name(client, fake_engines, body, needle):
    payload = {"model": "chat", "max_tokens": 64, "messages": ASK, **body}
    payload = {key: value for key, value in payload.items() if value is not None}
    response = client.post("/v1/messages", json=payload)
    assert_anthropic_error(response, 400, "invalid_request_error", needle)
    assert not fake_engines.engines["smol"].submitted


def test_count_tokens_refuses_what_messages_refuses(client):
    response = client.post("/v1/messages/count_tokens", json={"model": "chat", "messages": ASK, "max_tokens": 5})
    assert_anthropic_error(response, 400, "invalid_request_error", "max_tokens: not supported")


#: What each route needs besides model and messages.
SAMPLING = {"/v1/messages": {"max_tokens": 8}, "/v1/messages/count_tokens": {}}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_an_unknown_pipeline_is_not_found(client, path):
    response = client.post(path, json={"model": "nope", "messages": ASK, **SAMPLING[path]})
    assert_anthropic_error(response, 404, "not_found_error", "nope")


@pytest.mark.parametrize("body", [b"{not json", b"[]", b'{"model": "chat"}'])
def test_a_malformed_body_is_anthropics_400(client, body):
    response = client.post("/v1/messages", content=body, headers={"content-type": "application/json"})
    assert_anthropic_error(response, 400, "invalid_request_error")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_keys_come_as_x_api_key(auth_client, keys, path):
    body = {"model": "chat", "messages": ASK, **SAMPLING[path]}
    assert_anthropic_error(auth_client.post(path, json=body), 401, "authentication_error", "x-api-key")
    assert_anthropic_error(auth_client.post(path, json=body, headers={"x-api-key": "il_wrong"}), 401,
                           "authentication_error", "unknown or revoked")
    _, auditor = keys.create("reviewer", "auditor")
    assert_anthropic_error(auth_client.post(path, json=body, headers={"x-api-key": auditor}), 403,
                           "permission_error", "may not")
    _, caller = keys.create("app", "caller")
    assert auth_client.post(path, json=body, headers={"x-api-key": caller}).status_code == 200
    assert auth_client.post(path, json=body, headers={"authorization": f"Bearer {caller}"}).status_code == 200


# -- the anthropic package, against a real server on the real model ------------------------------------
