"""The request bodies of Anthropic's Messages API, and what they become for a pipeline.

``POST /v1/messages`` takes :class:`MessagesRequest`, ``POST /v1/messages/count_tokens``
:class:`CountTokensRequest` (serving/http/anthropic_routes.py). :func:`conversation` checks what the
body's schema cannot (the content blocks, the tools, how turns and tool results follow each other, as
Anthropic checks them: its 400s are ours) and turns the request into chat turns and OpenAI-shaped
``tools``/``tool_choice`` (:mod:`stages.tools`):

- ``system`` (a string or text blocks) is the first, system, turn;
- a user turn's ``tool_result`` blocks become ``<tool_response>`` text before its own text, an
  assistant turn's ``tool_use`` blocks the JSON calls the model would have written
  (:func:`stages.tools.call_text`); consecutive turns of one role are one turn, as Anthropic merges them;
- ``tools`` (client tools: ``name``, ``description``, ``input_schema``) are offered as functions;
  ``tool_choice`` ``auto`` | ``any`` | ``tool`` (with ``name``) | ``none`` is OpenAI's ``auto`` |
  ``required`` | that function | ``none``. At most one call is made, so ``disable_parallel_tool_use``
  is taken either way.

Refused by name (400) rather than ignored: fields we do not know or do not do (``thinking``,
``service_tier``, ``mcp_servers``...), image, document and every other block but ``text``,
``tool_use`` and ``tool_result``, server tools, and a last assistant turn (Anthropic continues it:
prefill), which a pipeline's prompt cannot. ``cache_control`` is taken on blocks and tools and needs
nothing: the engine's prefix cache keeps every prompt's prefix. A reply resent as the ``anthropic``
package dumps it (``model_dump()``: ``citations``, ``caller`` and ``toolset_name`` as ``None``, or the
caller ``{"type": "direct"}``) is taken; citations, toolsets and server tools' calls set there are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter

from pipeline.context import ChatMessage
from serving.http.problems import bad_request, checked
from serving.http.tool_replies import parameters_problem
from stages import tools


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


def _none_only(what: str) -> AfterValidator:
    """Take a field of the SDK's own blocks when it is empty (``model_dump()`` sends it as ``None``); refuse
    it, naming *what* this server does not do, when it is set."""
    def check(value: Any) -> None:
        if value is not None:
            raise ValueError(f"{what} are not supported by this server; send the block without them")
    return AfterValidator(check)


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(min_length=1)
    cache_control: CacheControl | None = None
    #: An assistant reply's text block, resent as the SDK dumps it (``citations: None``).
    citations: Annotated[Any, _none_only("citations")] = None


class DirectCaller(BaseModel):
    """A tool call the model made itself (the SDK's ``DirectCaller``)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["direct"]


def _caller(value: Any) -> Any:
    """The SDK's ``caller``: the model's own call, or none; a server tool's (code execution) is refused by name."""
    if value is None or (isinstance(value, dict) and value.get("type") == "direct"):
        return value
    if not isinstance(value, dict):
        raise ValueError('expected {"type": "direct"} or null')
    raise ValueError(f"calls made by server tool {json.dumps(value.get('type'))[:60]} are not supported by this "
                     'server; only the model\'s own ({"type": "direct"}) are')


class ToolUseBlock(BaseModel):
    """An assistant turn's tool call, as the client got it back: the SDK's ``ToolUseBlock`` resent with
    ``model_dump()`` (``caller`` and ``toolset_name`` set to ``None``) is taken as it is."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: str = Field(pattern=r"^[a-zA-Z0-9_-]+$")
    name: str = Field(min_length=1, max_length=200)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: Annotated[DirectCaller | None, BeforeValidator(_caller)] = None
    toolset_name: Annotated[Any, _none_only("toolsets")] = None


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: str = Field(pattern=r"^[a-zA-Z0-9_-]+$")
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        content = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)
        return f"Error: {content}" if self.is_error else content


class ToolParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str = ""
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


_USER_BLOCK: TypeAdapter[Any] = TypeAdapter(Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")])
_ASSISTANT_BLOCK: TypeAdapter[Any] = TypeAdapter(Annotated[TextBlock | ToolUseBlock, Field(discriminator="type")])
_SYSTEM_BLOCK: TypeAdapter[TextBlock] = TypeAdapter(TextBlock)
_TOOL: TypeAdapter[ToolParam] = TypeAdapter(ToolParam)
_BLOCK_TYPES = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    #: Blocks are checked by :func:`conversation`, so that one we do not take is refused by its name.
    content: str | list[dict[str, Any]]


class ToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: The end user: kept as the request's ``user`` tag, as the OpenAI API's ``user``.
    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(BaseModel):
    """The body of ``POST /v1/messages/count_tokens``."""

    # A field we do not know is kept aside and refused by name: never ignored.
    model_config = ConfigDict(extra="allow")
    model: str = Field(description="A pipeline (`name` or `name@version`).")
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="Client tools: {name, description, input_schema}.")
    tool_choice: ToolChoiceParam | None = None

    def refused_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class MessagesRequest(CountTokensRequest):
    """The body of ``POST /v1/messages``."""

    max_tokens: int = Field(ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = Field(None, max_length=64)
    stream: bool = False
    metadata: Metadata | None = None

    def overrides(self) -> dict[str, Any]:
        """The sampling options it sets (the pipeline's ``generate`` decides which a caller may set)."""
        return self.model_dump(include={"max_tokens", "temperature", "top_p", "top_k"}, exclude_none=True)


@dataclass
class Conversation:
    """A request as a pipeline takes it: chat turns, and OpenAI-shaped tools and tool choice."""

    messages: list[ChatMessage]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]


def conversation(data: CountTokensRequest) -> Conversation:
    """*data*'s turns, tools and tool choice; a 400 naming the field Anthropic would name otherwise."""
    if refused := data.refused_fields():
        raise bad_request(f"{', '.join(refused)}: not supported by this server (a parameter is refused, never "
                          "ignored); send the request without it", refused[0])
    offered = _tools(data.tools)
    choice = _tool_choice(data.tool_choice, offered)
    turns = [ChatMessage("system", _system(data.system))] if data.system else []
    if data.messages[0].role != "user":
        raise bad_request('messages[0].role: the first message must use the "user" role', "messages")
    if data.messages[-1].role != "user":
        raise bad_request('messages: the last message must use the "user" role; continuing a final assistant '
                          "turn (prefill) is not supported by this server", "messages")
    pending: list[str] = []  # the tool_use ids of the previous turn, which this one must answer
    seen: set[str] = set()
    for index, message in enumerate(data.messages):
        blocks = _blocks(message, index)
        pending = _check_tool_blocks(index, blocks, pending, seen, bool(offered))
        text = "\n".join(_text(block) for kind in (ToolResultBlock, TextBlock, ToolUseBlock)
                         for block in blocks if isinstance(block, kind))  # results first, calls last
        if turns and turns[-1].role == message.role:
            turns[-1].content += "\n" + text  # Anthropic merges consecutive turns of one role
        else:
            turns.append(ChatMessage(message.role, text))
    return Conversation(turns, offered, choice)


def _text(block: TextBlock | ToolUseBlock | ToolResultBlock) -> str:
    """A block as the model sees it: a call as the JSON it would have written, a result in its tags."""
    if isinstance(block, ToolResultBlock):
        return tools.result_text(block.text())
    if isinstance(block, ToolUseBlock):
        return tools.call_text(block.name, json.dumps(block.input))
    return block.text


def _check_tool_blocks(index: int, blocks: list[Any], pending: list[str], seen: set[str],
                       has_tools: bool) -> list[str]:
    """Check turn *index*'s tool blocks as Anthropic does: its results answer exactly the calls of the turn
    before (*pending*), its calls' ids are new (*seen*, updated), tools are defined. Returns its calls' ids."""
    if any(not isinstance(b, TextBlock) for b in blocks) and not has_tools:
        raise bad_request(f"messages[{index}].content: requests that include tool_use or tool_result blocks "
                          "must define tools", "messages")
    answered = [b.tool_use_id for b in blocks if isinstance(b, ToolResultBlock)]
    if unexpected := [i for i in answered if i not in pending]:
        raise bad_request(f"messages[{index}].content: unexpected tool_use_id {unexpected[0]!r} in tool_result "
                          "blocks: each tool_result must answer a tool_use of the previous message", "messages")
    if missing := [i for i in pending if i not in answered]:
        raise bad_request(f"messages[{index}]: tool_use ids were found without tool_result blocks immediately "
                          f"after: {', '.join(missing)}", "messages")
    calls = [b.id for b in blocks if isinstance(b, ToolUseBlock)]
    if repeated := [i for i in calls if i in seen]:
        raise bad_request(f"messages[{index}].content: tool_use ids must be unique: {repeated[0]!r}", "messages")
    seen.update(calls)
    return calls


def _system(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    return "\n".join(_block(_SYSTEM_BLOCK, block, f"system[{index}]", ("text",)).text
                     for index, block in enumerate(system))


def _blocks(message: MessageParam, index: int) -> list[Any]:
    if isinstance(message.content, str):
        if not message.content:
            raise bad_request(f"messages[{index}].content: messages must have non-empty content", "messages")
        return [TextBlock(type="text", text=message.content)]
    if not message.content:
        raise bad_request(f"messages[{index}].content: messages must have non-empty content", "messages")
    adapter = _USER_BLOCK if message.role == "user" else _ASSISTANT_BLOCK
    return [_block(adapter, block, f"messages[{index}].content[{at}]", _BLOCK_TYPES[message.role])
            for at, block in enumerate(message.content)]


def _block(adapter: TypeAdapter[Any], block: dict[str, Any], where: str, types: tuple[str, ...]) -> Any:
    kind = block.get("type")
    if kind not in types:
        raise bad_request(f"{where}.type: {json.dumps(kind)[:60]} blocks are not supported here by this server "
                          f"(it takes {', '.join(types)})", where.split("[", 1)[0])
    return checked(adapter, block, where)


def _tools(value: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The client tools, as OpenAI's ``tools``."""
    offered = []
    for index, tool in enumerate(value or []):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad_request(f"tools[{index}].type: server tool {json.dumps(kind)[:60]} is not supported by this "
                              "server; only client tools ({name, description, input_schema}) are", "tools")
        param = checked(_TOOL, tool, f"tools[{index}]")
        if (problem := parameters_problem(param.input_schema)) is not None:
            raise bad_request(f"tools[{index}].input_schema: {problem}", "tools")
        offered.append({"type": "function", "function": {
            "name": param.name, "description": param.description, "parameters": param.input_schema}})
    names = [t["function"]["name"] for t in offered]
    if len(set(names)) != len(names):
        raise bad_request("tools: tool names must be unique", "tools")
    return offered


def _tool_choice(choice: ToolChoiceParam | None, offered: list[dict[str, Any]]) -> str | dict[str, Any]:
    """*choice* as OpenAI's ``tool_choice``."""
    if choice is None:
        return "auto"
    if not offered and choice.type != "none":
        raise bad_request("tool_choice: may only be specified while providing tools", "tool_choice")
    if choice.type != "tool":
        if choice.name is not None:
            raise bad_request(f"tool_choice.name: only with type 'tool', not {choice.type!r}", "tool_choice")
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.name not in tools.functions(offered):
        raise bad_request(f"tool_choice.name: no tool {choice.name!r} in tools", "tool_choice")
    return {"type": "function", "function": {"name": choice.name}}
