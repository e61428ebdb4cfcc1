"""Function calling: how offered functions reach the model, and how its reply becomes a call.

Not a stage of its own: a request carries ``tools`` (OpenAI's shape, ``[{"type": "function",
"function": {"name", "description", "parameters"}}]``) and ``tool_choice`` (``auto`` | ``none`` |
``required`` | ``{"type": "function", "function": {"name": ...}}``), which the OpenAI API sets. The
``tokenize`` stage renders them (:func:`prompt_encoder`); a pipeline needs nothing else, as long as
its ``generate`` stage lets callers set ``output`` (the default), which constrains a forced call (a
``generate`` with an ``output`` of its own must also say ``caller_may_override: true``)::

    - id: gen
      type: generate
      with: {max_tokens: 256, temperature: 0, client_params: [max_tokens, temperature, output]}

Rendering: a tokenizer whose chat template takes tools (it has ``encode_chat_tools``, returning None
when the template ignores them) gets them as they are. Otherwise, as with SmolLM2's template, a
preamble appended to the system message lists the functions and asks for exactly one JSON object
``{"name": ..., "arguments": {...}}``. Earlier calls and their results travel as text in the same
format (:func:`call_text`, :func:`result_text`).

Reading the reply: with ``required`` or a named function, :func:`call_schema` constrains the output to
a valid call. With ``auto``, :func:`parse_call` accepts a reply that is such an object (bare, in
```json fences or in ``<tool_call>`` tags) naming a known function whose arguments validate against its
``parameters`` schema (``jsonschema``); anything else is plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from pipeline.protocols import Tokenizer

Turns = list[dict[str, str]]
Encoder = Callable[[Turns], list[int]]

#: Openings a tool call may start with, besides a bare ``{``.
_OPENERS = ("```json", "```", "<tool_call>")
_FENCED = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)
_TAGGED = re.compile(r"\A<tool_call>\s*(.*?)\s*(?:</tool_call>)?\Z", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: ``arguments`` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def functions(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The offered functions by name (each ``{"name", "description", "parameters"}``)."""
    return {tool["function"]["name"]: tool["function"] for tool in tools}


def is_offered(tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any]) -> bool:
    return bool(tools) and choice != "none"


def forced_names(tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any]) -> list[str]:
    """The functions the reply must call one of: all with ``required``, the named one, none otherwise."""
    if not tools:
        return []
    if choice == "required":
        return list(functions(tools))
    if isinstance(choice, Mapping):
        return [choice["function"]["name"]]
    return []


def call_schema(tools: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """A JSON schema that only a call of one of *names*, with valid arguments, matches."""
    by_name = functions(tools)
    options = [{"type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters_of(by_name[name])},
                "required": ["name", "arguments"], "additionalProperties": False} for name in names]
    return options[0] if len(options) == 1 else {"anyOf": options}


def parameters_of(function: Mapping[str, Any]) -> dict[str, Any]:
    """The schema of a function's arguments, which are always an object."""
    return {"type": "object", **(function.get("parameters") or {})}


# -- the prompt -------------------------------------------------------------------


def prompt_encoder(tokenizer: Tokenizer, turns: Turns, tools: Sequence[Mapping[str, Any]],
                   choice: str | Mapping[str, Any]) -> tuple[Encoder, Turns]:
    """How to encode the conversation with *tools* offered, and the turns to encode: the chat
    template's own tool rendering where it has one, else *turns* with the tools in the system message."""
    if not is_offered(tools, choice):
        return tokenizer.encode_chat, turns
    native = getattr(tokenizer, "encode_chat_tools", None)
    if native is not None and native(turns, list(tools)) is not None:
        return (lambda kept: native(kept, list(tools))), turns
    return tokenizer.encode_chat, with_preamble(turns, tools, choice)


def with_preamble(turns: Turns, tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any]) -> Turns:
    """*turns* with :func:`preamble` appended to the system message (or as one, first)."""
    text = preamble(tools, choice)
    if turns and turns[0]["role"] == "system":
        return [{"role": "system", "content": f"{turns[0]['content']}\n\n{text}"}, *turns[1:]]
    return [{"role": "system", "content": text}, *turns]


def preamble(tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any]) -> str:
    """The functions, and how to call one, for a chat template that does not render tools."""
    listed = "\n".join(json.dumps({"name": f["name"], "description": f.get("description", ""),
                                   "parameters": parameters_of(f)}, ensure_ascii=False)
                       for f in functions(tools).values())
    forced = forced_names(tools, choice)
    if len(forced) == 1 and isinstance(choice, Mapping):
        task = f"You must call the function {forced[0]}."
    elif forced:
        task = "You must call one of these functions."
    else:
        task = "Call one if it helps to answer; if none is needed, answer in plain text."
    return (f"You can call these functions:\n{listed}\n\n{task} To call a function, reply with exactly one "
            'JSON object and nothing else: {"name": <function name>, "arguments": <object of its arguments>}. '
            "A function's result comes back in <tool_response> tags.")


def call_text(name: str, arguments: str) -> str:
    """An earlier call in the conversation, as the model would have written it."""
    try:
        parsed: Any = json.loads(arguments or "{}")
    except ValueError:
        parsed = arguments
    return json.dumps({"name": name, "arguments": parsed}, ensure_ascii=False)


def result_text(content: str) -> str:
    """A function's result, as the user turn that brings it back."""
    return f"<tool_response>\n{content}\n</tool_response>"


# -- the reply --------------------------------------------------------------------


def could_be_call(prefix: str) -> bool:
    """Whether a reply starting with *prefix* may still turn out to be a tool call (streaming holds
    it back until then)."""
    head = prefix.lstrip()
    return not head or head.startswith("{") or any(o.startswith(head) or head.startswith(o) for o in _OPENERS)


def parse_call(text: str, tools: Sequence[Mapping[str, Any]]) -> ToolCall | None:
    """The call *text* makes, or None when it is plain content: not one JSON object naming an offered
    function, or arguments its ``parameters`` schema rejects."""
    body = text.strip()
    for wrapper in (_FENCED, _TAGGED):
        match = wrapper.match(body)
        if match:
            body = match.group(1)
            break
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    function = functions(tools).get(data["name"])
    arguments = data.get("arguments", data.get("parameters"))  # Llama 3.1 writes "parameters"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if function is None or not isinstance(arguments, dict) or schema_errors(arguments, parameters_of(function)):
        return None
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


# -- validation ---------------------------------------------------------------------


def schema_problem(schema: Mapping[str, Any]) -> str | None:
    """Why *schema* is not a valid JSON Schema (2020-12), or None."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return f"{exc.message} at {'/'.join(map(str, exc.absolute_path)) or '/'}"
    return None


def strict_problem(schema: Mapping[str, Any], path: str = "") -> str | None:
    """Why *schema* cannot be used with ``strict: true`` (OpenAI's rules), or None: every object lists
    all its properties in ``required`` and sets ``additionalProperties: false``, so an answer can be
    neither short of a property nor carry one the schema does not name."""
    if schema.get("type") == "object" or "properties" in schema:
        if schema.get("additionalProperties") is not False:
            return f"{path or '/'}: 'additionalProperties' must be false with strict: true"
        missing = sorted(set(schema.get("properties", {})) - set(schema.get("required", [])))
        if missing:
            return f"{path or '/'}: 'required' must name every property with strict: true; missing {missing}"
    children = [(f"{path}/properties/{name}", value) for name, value in schema.get("properties", {}).items()]
    children += [(f"{path}/{key}", schema[key]) for key in ("items", "additionalItems") if key in schema]
    children += [(f"{path}/{key}/{i}", value) for key in ("anyOf", "allOf", "oneOf", "prefixItems")
                 for i, value in enumerate(schema.get(key, []))]
    children += [(f"{path}/{key}/{name}", value) for key in ("$defs", "definitions")
                 for name, value in schema.get(key, {}).items()]
    for where, child in children:
        if isinstance(child, Mapping) and (problem := strict_problem(child, where)):
            return problem
    return None


def schema_errors(value: Any, schema: Mapping[str, Any]) -> list[str]:
    """Where *value* breaks *schema* (a JSON Schema, checked with :func:`schema_problem` beforehand)."""
    return [f"{'/'.join(map(str, e.absolute_path)) or '/'}: {e.message}"
            for e in Draft202012Validator(schema).iter_errors(value)]
