"""The OpenAI API's structured output and function calling: ``response_format``, ``tools``, ``tool_choice``,
tool results in the history, and tool calls streamed. Over fake engines (what reaches the engine, and
how the reply is read back), then on the real model (the reply constrained to a valid call)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai import BadRequestError, OpenAI

from stages import tools
from tests.serving import workspaces as serving

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
STRICT = {**SCHEMA, "additionalProperties": False}


@pytest.fixture
def client(tmp_path, monkeypatch, fake_engines):
    """The app over fake engines, with room for a tool call wrapped in tags in ``max_tokens``."""
    monkeypatch.setattr(serving, "CHAT", serving.CHAT.replace("max_tokens: 64", "max_tokens: 128"))
    with serving.client_for(tmp_path, monkeypatch, fake_engines, auth=False) as test_client:
        yield test_client


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "chat", "messages": ASK, **body})


def sampled(fake_engines):
    """The sampling parameters of the last request the engine got."""
    return fake_engines.engines["smol"].submitted[-1][1]


def prompt(fake_engines) -> bytes:
    return bytes(fake_engines.engines["smol"].submitted[-1][0])


def reply(fake_engines, text: str) -> None:
    fake_engines.engines["smol"].reply = text.encode()


def openai_client(client) -> OpenAI:
    return OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)


# -- response_format ----------------------------------------------------------------------


@pytest.mark.parametrize(("response_format", "output"), [
    (None, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"json_schema": {"type": "object"}}),
    ({"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}, {"json_schema": SCHEMA}),
    ({"type": "json_schema", "json_schema": {"name": "answer", "schema": STRICT, "strict": True}},
     {"json_schema": STRICT}),
])
def test_response_format_becomes_the_output_constraint(client, fake_engines, response_format, output):
    response = chat(client, **({"response_format": response_format} if response_format else {}))
    assert response.status_code == 200, response.text
    assert sampled(fake_engines).output == output
    assert response.json()["choices"][0]["message"]["content"] == "Paris is the capital of France."


@pytest.mark.parametrize(("response_format", "needle"), [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema: Field required"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}, "json_schema.schema"),
])
def test_a_malformed_response_format_is_openais_400(client, fake_engines, response_format, needle):
    response = chat(client, response_format=response_format)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    assert needle in error["message"]
    assert not fake_engines.engines["smol"].submitted


OWN_OUTPUT = "output: {json_schema: {type: object, required: [answer]}}"


@pytest.fixture
def own_output_client(tmp_path, monkeypatch, fake_engines, request):
    """The app whose chat pipeline has its own ``output`` (with ``caller_may_override: true`` where the test is
    parametrized with True)."""
    own = OWN_OUTPUT.replace("}}", "}, caller_may_override: true}") if getattr(request, "param", False) else OWN_OUTPUT
    monkeypatch.setattr(serving, "CHAT", serving.CHAT.replace("temperature: 0}", f"temperature: 0, {own}}}"))
    with serving.client_for(tmp_path, monkeypatch, fake_engines, auth=False) as test_client:
        yield test_client


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}},
    {"tools": [WEATHER], "tool_choice": "required"},  # a forced call would replace the pipeline's output too
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_response_format_does_not_replace_the_pipelines_own_output(own_output_client, fake_engines, body, stream):
    response = chat(own_output_client, **body, stream=stream)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "this pipeline has its own output constraint (json_schema)" in error["message"]
    assert "caller_may_override: true" in error["message"]
    assert not fake_engines.engines["smol"].submitted
    assert chat(own_output_client, response_format={"type": "text"}).status_code == 200  # no format: its own
    assert sampled(fake_engines).output == {"json_schema": {"type": "object", "required": ["answer"]}}


@pytest.mark.parametrize("own_output_client", [True], indirect=True)
def test_a_pipeline_may_let_a_response_format_replace_its_output(own_output_client, fake_engines):
    response = chat(own_output_client, response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": SCHEMA}})
    assert response.status_code == 200, response.text
    assert sampled(fake_engines).output == {"json_schema": SCHEMA}


# -- tools, over a fake engine ---------------------------------------------------------------


def test_tool_choice_required_constrains_the_reply_to_a_call(client, fake_engines):
    reply(fake_engines, CALL)
    response = chat(client, tools=[WEATHER], tool_choice="required")
    assert response.status_code == 200, response.text
    assert sampled(fake_engines).output == {"json_schema": tools.call_schema([WEATHER], ["get_weather"])}
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_several_functions_required_is_any_of_their_calls(client, fake_engines):
    reply(fake_engines, '{"name": "get_time", "arguments": {"zone": "CET"}}')
    response = chat(client, tools=[WEATHER, TIME], tool_choice="required")
    schema = sampled(fake_engines).output["json_schema"]
    assert [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["get_weather", "get_time"]
    assert response.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_a_named_function_is_the_only_one_allowed(client, fake_engines):
    reply(fake_engines, CALL)
    chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert sampled(fake_engines).output == {"json_schema": tools.call_schema([WEATHER], ["get_weather"])}
    assert b"You must call the function get_weather." in prompt(fake_engines)


@pytest.mark.parametrize("text", [CALL, f"```json\n{CALL}\n```", f"<tool_call>\n{CALL}\n</tool_call>"])
def test_auto_reads_a_call_from_the_reply(client, fake_engines, text):
    reply(fake_engines, text)
    response = chat(client, tools=[WEATHER])  # tool_choice defaults to auto
    assert sampled(fake_engines).output is None
    assert b"You can call these functions:\n" + json.dumps(WEATHER["function"]).encode() in prompt(fake_engines)
    message = response.json()["choices"][0]["message"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("text", ["It is sunny in Paris.", '{"name": "get_weather", "arguments": {"town": "Paris"}}',
                                  '{"name": "get_news", "arguments": {}}'])
def test_auto_returns_anything_but_a_valid_call_as_content(client, fake_engines, text):
    reply(fake_engines, text)
    choice = chat(client, tools=[WEATHER], tool_choice="auto").json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "stop"


def test_tool_choice_none_offers_nothing(client, fake_engines):
    reply(fake_engines, CALL)
    choice = chat(client, tools=[WEATHER], tool_choice="none").json()["choices"][0]
    assert choice["message"]["content"] == CALL and "tool_calls" not in choice["message"]
    assert b"get_weather" not in prompt(fake_engines) and sampled(fake_engines).output is None


def test_auto_with_a_response_format_allows_the_format_or_a_call(client, fake_engines):
    chat(client, tools=[WEATHER], response_format={"type": "json_object"})
    assert sampled(fake_engines).output == {"json_schema": {"anyOf": [
        {"type": "object"}, tools.call_schema([WEATHER], ["get_weather"])]}}


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"tools": {"type": "function"}}, "tools", "tools: Input should be a valid list"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}, "tools",
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "must be 'object'"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "expected 'auto', 'none', 'required' or"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "no function 'get_time' in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    # strict: true asks for OpenAI's strict schema rules, as OpenAI checks them; an unknown field is refused.
    ({"tools": [{"type": "function", "function": {**WEATHER["function"], "strict": True}}]}, "tools",
     "tools[0].function.parameters: /: 'additionalProperties' must be false"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["a"],
        "properties": {"a": {"type": "string"}, "b": {"type": "object", "properties": {}}}}}}]}, "tools",
     "missing ['b']"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["b"],
        "properties": {"b": {"type": "object", "properties": {"c": {"type": "string"}}}}}}}]}, "tools",
     "/properties/b: 'additionalProperties' must be false"),
    ({"tools": [{"type": "function", "function": {**WEATHER["function"], "returns": "str"}}]}, "tools",
     "tools[0].function.returns: Extra inputs are not permitted"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     "response_format", "'additionalProperties' must be false"),
])
def test_malformed_tools_are_openais_400(client, fake_engines, body, param, needle):
    response = chat(client, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param) and needle in error["message"]


def test_a_strict_function_is_called_under_its_schema(client, fake_engines):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True, "parameters": {
        **WEATHER["function"]["parameters"], "additionalProperties": False}}}
    reply(fake_engines, CALL)
    response = chat(client, tools=[strict], tool_choice="required")
    assert response.status_code == 200, response.text
    assert sampled(fake_engines).output == {"json_schema": tools.call_schema([strict], ["get_weather"])}
    assert response.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(("tool_choice", "content"), [
    ("required", None), ({"type": "function", "function": {"name": "get_weather"}}, None),
    ("auto", CALL[:20]),  # not forced, the text may be an answer that starts like JSON: the model's content
])
def test_a_forced_call_cut_by_max_tokens_is_length_and_no_call(client, fake_engines, tool_choice, content):
    reply(fake_engines, CALL)
    response = chat(client, tools=[WEATHER], tool_choice=tool_choice, max_tokens=20)  # CALL is 54 bytes
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": content}  # forced: neither half a call nor its text


def test_a_streamed_forced_call_cut_by_max_tokens_is_length_and_no_call(client, fake_engines):
    reply(fake_engines, CALL)
    response = chat(client, tools=[WEATHER], tool_choice="required", max_tokens=20, stream=True)
    lines = [line for line in response.text.splitlines() if line]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": None}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and lines[-1] == "data: [DONE]"
    completion = openai_client(client).chat.completions.create(model="chat", messages=ASK, tools=[WEATHER],
                                                               tool_choice="required", max_tokens=20)
    result = completion.choices[0]
    assert result.finish_reason == "length" and result.message.content is None and not result.message.tool_calls


def test_tool_results_in_the_history(client, fake_engines):
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_time",
                                                                      "arguments": '{"zone": "CET"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
                {"role": "tool", "tool_call_id": "call_2", "content": "14:05"}]
    response = client.post("/v1/chat/completions", json={"model": "chat", "messages": messages,
                                                         "tools": [WEATHER, TIME]})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Paris is the capital of France."
    calls = "\n".join(tools.call_text(n, a) for n, a in [("get_weather", '{"city": "Paris"}'),
                                                         ("get_time", '{"zone": "CET"}')])
    assert prompt(fake_engines).endswith(
        f"<user>What is the weather in Paris?<assistant>{calls}"
        '<user><tool_response>\n{"temp_c": 21}\n</tool_response>\n<tool_response>\n14:05\n</tool_response>'.encode())


# -- through the openai package -------------------------------------------------------------------


def test_the_openai_client_reads_a_tool_call(client, fake_engines):
    reply(fake_engines, CALL)
    completion = openai_client(client).chat.completions.create(model="chat", messages=ASK, tools=[WEATHER],
                                                               tool_choice="required")
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_a_streamed_tool_call(client, fake_engines, tool_choice):
    reply(fake_engines, f"<tool_call>\n{CALL}\n</tool_call>" if tool_choice == "auto" else CALL)
    stream = openai_client(client).chat.completions.create(
        model="chat", messages=ASK, tools=[WEATHER], tool_choice=tool_choice, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(not d.content for d in deltas)
    head = deltas[0].tool_calls[0]
    assert deltas[0].role == "assistant" and head.index == 0 and head.id.startswith("call_")
    assert (head.type, head.function.name, head.function.arguments) == ("function", "get_weather", "")
    arguments = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [])
    assert json.loads(arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_the_openai_stream_helper_accumulates_the_call(client, fake_engines):
    reply(fake_engines, CALL)
    with openai_client(client).chat.completions.stream(model="chat", messages=ASK, tools=[WEATHER],
                                                       tool_choice="required") as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert final.choices[0].finish_reason == "tool_calls"


def test_streamed_content_with_tools_offered_still_streams(client, fake_engines):
    reply(fake_engines, "It is sunny in Paris today.")
    chunks = list(openai_client(client).chat.completions.create(model="chat", messages=ASK, tools=[WEATHER],
                                                                stream=True))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(contents) == "It is sunny in Paris today." and len(contents) > 1  # not held to the end
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streamed_content_that_looked_like_a_call(client, fake_engines):
    reply(fake_engines, '{"city": "Paris"}')
    lines = [line for line in chat(client, tools=[WEATHER], stream=True).text.splitlines() if line]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": '{"city": "Paris"}'}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and lines[-1] == "data: [DONE]"


# -- on the real model ------------------------------------------------------------------------------

ROOT = Path(__file__).parents[3]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    from tests.serving.cli.test_serve import Server  # imported here: fast runs need not start it

    running = Server(tmp_path_factory.mktemp("tools-server"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def real_client(real_server):
    with OpenAI(base_url=f"{real_server.url}/v1", api_key=real_server.key("caller")) as client:
        yield client


@pytest.mark.slow
@pytest.mark.integration
def test_the_real_model_makes_a_valid_forced_call(real_client):
    """Needs the engine's constrained decoding (``output``): the 135M model calls get_weather with valid
    arguments because nothing else can be generated."""
    client = real_client
    weather = {**WEATHER, "function": {**WEATHER["function"], "parameters": {
        **WEATHER["function"]["parameters"], "additionalProperties": False}}}
    for model, choice in [("tool_call", "required"), ("chat", {"type": "function",
                                                               "function": {"name": "get_weather"}})]:
        completion = client.chat.completions.create(model=model, messages=ASK, tools=[weather, TIME],
                                                    tool_choice=choice, max_tokens=64)
        result = completion.choices[0]
        assert result.finish_reason == "tool_calls", result.message.content
        call = result.message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        assert call.function.name in {"get_weather", "get_time"}
        assert tools.schema_errors(arguments, tools.functions([weather, TIME])[call.function.name]["parameters"]) == []
    streamed = list(client.chat.completions.create(model="tool_call", messages=ASK, tools=[weather],
                                                   tool_choice="required", max_tokens=64, stream=True))
    arguments = "".join(t.function.arguments or "" for c in streamed if c.choices
                        for t in c.choices[0].delta.tool_calls or [])
    assert tools.schema_errors(json.loads(arguments), weather["function"]["parameters"]) == []
    followup = client.chat.completions.create(model="tool_call", max_tokens=32, tools=[weather], messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "clear"}'}])
    assert followup.choices[0].finish_reason in {"stop", "length", "tool_calls"}


@pytest.mark.slow
@pytest.mark.integration
def test_the_real_model_answers_in_the_response_format(real_server, real_client):
    completion = real_client.chat.completions.create(
        model="tool_call", messages=ASK, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": {
            **SCHEMA, "additionalProperties": False}}})
    # The 135M model rambles past 64 tokens inside the string; the schema still decides how it starts.
    assert completion.choices[0].message.content.startswith('{"answer": "')
    with pytest.raises(BadRequestError, match="uniqueItems"):  # the engine names what it cannot enforce
        real_client.chat.completions.create(model="tool_call", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array", "uniqueItems": True}}})
