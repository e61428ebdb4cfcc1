"""Function calling's pure parts (rendering, the forced-call schema, reading a reply) and tokenize with tools."""

from __future__ import annotations

import json
import textwrap

import pytest

from pipeline.context import ChatMessage, RequestContext
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from stages import tools
from tests.fakes import ByteTokenizer, FakeEngines

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


class NativeTokenizer(ByteTokenizer):
    """A tokenizer whose chat template renders tools itself."""

    def __init__(self, renders_tools: bool = True):
        self.renders_tools = renders_tools
        self.calls: list[tuple[list, list]] = []

    def encode_chat_tools(self, messages, tools_):
        self.calls.append((list(messages), list(tools_)))
        if not self.renders_tools:
            return None
        return self.encode_chat(messages) + list(b"<tools>" + json.dumps(tools_).encode())


# -- rendering ------------------------------------------------------------------------


def test_the_preamble_joins_the_system_message_and_lists_every_function():
    turns = tools.with_preamble(TURNS, TOOLS, "auto")
    assert [t["role"] for t in turns] == ["system", "user"] and turns[1] == TURNS[1]
    system = turns[0]["content"]
    assert system.startswith("Be brief.\n\nYou can call these functions:")
    listed = [json.loads(line) for line in system.splitlines() if line.startswith("{")]
    assert listed == [{"name": "get_weather", "description": "Current weather for a city.",
                       "parameters": WEATHER["function"]["parameters"]},
                      {"name": "get_time", "description": "", "parameters": TIME["function"]["parameters"]}]
    assert '{"name": <function name>, "arguments": <object of its arguments>}' in system
    assert "plain text" in system
    assert TURNS[0]["content"] == "Be brief."  # the caller's turns are not changed in place


def test_the_preamble_is_a_system_message_of_its_own_when_there_is_none():
    turns = tools.with_preamble(TURNS[1:], [WEATHER], "required")
    assert turns[0]["role"] == "system" and turns[0]["content"].startswith("You can call these functions:")
    assert "You must call one of these functions." in turns[0]["content"]
    named = tools.preamble(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert "You must call the function get_time." in named and "plain text" not in named


def test_prompt_encoder_falls_back_to_the_preamble_without_a_tool_template():
    for tokenizer in (ByteTokenizer(), NativeTokenizer(renders_tools=False)):
        encode, turns = tools.prompt_encoder(tokenizer, TURNS, TOOLS, "auto")
        assert turns == tools.with_preamble(TURNS, TOOLS, "auto")
        assert bytes(encode(turns)) == bytes(ByteTokenizer().encode_chat(turns))


def test_prompt_encoder_uses_the_chat_templates_own_tool_rendering():
    tokenizer = NativeTokenizer()
    encode, turns = tools.prompt_encoder(tokenizer, TURNS, TOOLS, "required")
    assert turns == TURNS  # no preamble: the template renders the tools
    assert bytes(encode(turns)).endswith(b"<tools>" + json.dumps(TOOLS).encode())
    assert tokenizer.calls[-1] == (TURNS, TOOLS)


@pytest.mark.parametrize(("offered", "choice"), [([], "auto"), (TOOLS, "none")])
def test_nothing_is_rendered_when_no_tool_is_offered(offered, choice):
    tokenizer = NativeTokenizer()
    encode, turns = tools.prompt_encoder(tokenizer, TURNS, offered, choice)
    assert turns == TURNS and encode == tokenizer.encode_chat and not tokenizer.calls


def test_history_calls_and_results_as_text():
    assert json.loads(tools.call_text("get_weather", '{"city": "Paris"}')) == json.loads(CALL)
    assert json.loads(tools.call_text("f", "")) == {"name": "f", "arguments": {}}
    assert json.loads(tools.call_text("f", "not json")) == {"name": "f", "arguments": "not json"}
    assert tools.result_text('{"temp": 21}') == '<tool_response>\n{"temp": 21}\n</tool_response>'


# -- the forced-call schema ------------------------------------------------------------


def test_forced_names():
    assert tools.forced_names(TOOLS, "required") == ["get_weather", "get_time"]
    assert tools.forced_names(TOOLS, {"type": "function", "function": {"name": "get_time"}}) == ["get_time"]
    assert tools.forced_names(TOOLS, "auto") == tools.forced_names(TOOLS, "none") == []
    assert tools.forced_names([], "required") == []


def test_call_schema_for_one_function_admits_only_its_valid_calls():
    schema = tools.call_schema(TOOLS, ["get_weather"])
    assert schema == {"type": "object", "properties": {"name": {"const": "get_weather"},
                                                       "arguments": WEATHER["function"]["parameters"]},
                      "required": ["name", "arguments"], "additionalProperties": False}
    assert tools.schema_problem(schema) is None
    assert tools.schema_errors(json.loads(CALL), schema) == []
    for bad in ({"name": "get_time", "arguments": {"city": "Paris"}},
                {"name": "get_weather", "arguments": {"town": "Paris"}},
                {"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}},
                {"name": "get_weather"}):
        assert tools.schema_errors(bad, schema), bad


def test_call_schema_for_several_functions_is_any_of_them():
    schema = tools.call_schema(TOOLS, ["get_weather", "get_time"])
    assert [option["properties"]["name"] for option in schema["anyOf"]] == [{"const": "get_weather"},
                                                                            {"const": "get_time"}]
    assert tools.schema_errors({"name": "get_time", "arguments": {"zone": "CET"}}, schema) == []
    assert tools.schema_errors({"name": "get_time", "arguments": {}}, schema)


def test_a_function_without_parameters_takes_an_object():
    bare = [{"type": "function", "function": {"name": "now"}}]
    schema = tools.call_schema(bare, ["now"])
    assert schema["properties"]["arguments"] == {"type": "object"}
    assert tools.parse_call('{"name": "now", "arguments": {}}', bare) is not None


# -- reading the reply -------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    CALL,
    f"  {CALL}\n",
    f"```json\n{CALL}\n```",
    f"```\n{CALL}\n```",
    f"<tool_call>\n{CALL}\n</tool_call>",
    f"<tool_call>{CALL}",  # the closing tag cut by a stop token
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',  # Llama 3.1's key
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',  # arguments as JSON text
])
def test_a_call_is_read_bare_fenced_or_tagged(text):
    call = tools.parse_call(text, TOOLS)
    assert call is not None and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and len(call.id) == 29
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": call.arguments}}


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    "",
    '{"name": "get_weather", "arguments": {"city": "Paris"}',  # cut short
    '{"name": "send_email", "arguments": {}}',  # not offered
    '{"name": "get_weather", "arguments": {"town": "Paris"}}',  # fails the schema
    '{"name": "get_weather", "arguments": {"city": 7}}',
    '{"name": "get_weather", "arguments": ["Paris"]}',
    '{"name": "get_weather", "arguments": "not json"}',
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    '{"city": "Paris"}',
    f"Sure! {CALL}",
])
def test_anything_else_is_content(text):
    assert tools.parse_call(text, TOOLS) is None


def test_each_call_gets_its_own_id():
    assert tools.parse_call(CALL, TOOLS).id != tools.parse_call(CALL, TOOLS).id


@pytest.mark.parametrize(("prefix", "may_be_call"), [
    ("", True), ("  \n", True), ("{", True), (' {"name"', True), ("`", True), ("```js", True),
    ("```json\n{", True), ("<", True), ("<tool_", True), ("<tool_call>\n{", True),
    ("The", False), ("<b>", False), ("[", False), ("``x", False),
])
def test_could_be_call(prefix, may_be_call):
    assert tools.could_be_call(prefix) is may_be_call


def test_schema_problem_names_what_is_wrong():
    assert "is not valid under any of the given schemas" in tools.schema_problem({"type": "objekt"})
    assert tools.schema_problem({"type": "object", "properties": {"a": {"type": "string"}}}) is None


# -- tokenize -------------------------------------------------------------------------------

CATALOG = Catalog(models={"smol": ModelInfo("smol")})
CHAT = """
name: chat
stages:
  - {id: prompt, type: prompt, with: {system: Be brief.}}
  - {id: tok, type: tokenize, with: {max_input_tokens: 2000, overflow: drop_oldest}}
  - {id: gen, type: generate, with: {max_tokens: 8, temperature: 0}}
  - {id: out, type: stream}
"""


async def _tokenize(registry, ctx: RequestContext, engines: FakeEngines) -> bytes:
    loaded = load_pipeline_text(textwrap.dedent(CHAT), "p.yaml", registry, CATALOG)
    async for _ in Runner().stream(Pipeline(loaded, Resources(CATALOG, engines=engines)), ctx):
        pass
    return bytes(engines.engines["smol"].submitted[0][0])


async def test_tokenize_lists_the_tools_in_the_system_message(registry):
    ctx = RequestContext.from_text("chat", "Weather in Paris?", tools=TOOLS, tool_choice="auto")
    prompt = await _tokenize(registry, ctx, FakeEngines())
    assert prompt.startswith(b"<system>Be brief.\n\nYou can call these functions:\n{\"name\": \"get_weather\"")
    assert prompt.endswith(b"<user>Weather in Paris?")
    # A fallback model or a remote backend gets the same conversation.
    assert ctx.messages[0].content == tools.with_preamble(TURNS, TOOLS, "auto")[0]["content"]


async def test_tokenize_without_tools_or_with_tool_choice_none_is_unchanged(registry):
    for kwargs in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        ctx = RequestContext.from_text("chat", "Weather in Paris?", **kwargs)
        assert await _tokenize(registry, ctx, FakeEngines()) == b"<system>Be brief.<user>Weather in Paris?"
        assert ctx.messages[0].content == "Be brief."


async def test_dropping_old_turns_keeps_the_tools(registry):
    history = [ChatMessage("user", "x" * 1500), ChatMessage("assistant", "y" * 100),
               ChatMessage("user", "Weather in Paris?")]
    ctx = RequestContext(pipeline="chat", input_messages=history, tools=TOOLS)
    prompt = await _tokenize(registry, ctx, FakeEngines())
    assert b"x" * 100 not in prompt and b"You can call these functions" in prompt
    assert [m.role for m in ctx.messages] == ["system", "user"]
