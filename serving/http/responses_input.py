"""The Responses API's ``input`` (:mod:`serving.http.responses_routes`): its items checked, and read as the chat
API's messages.

An item is a message (``role`` user, assistant, system or developer; ``content`` a string or a list of
``input_text``/``output_text`` parts; ``type: "message"`` optional), a ``function_call`` (``call_id``,
``name``, ``arguments``) or a ``function_call_output`` (``call_id``, ``output``), an ``mcp_approval_request``
sent back, or an ``mcp_approval_response`` (``approval_request_id``, ``approve``: the client's decision on a
tool call a paused response awaits, serving/http/approvals.py), or an ``mcp_list_tools``/``mcp_call`` item of an
earlier response sent back. An output item sent back as it is (with its ``id``, ``status``, ``annotations``) is
accepted; anything else, an image or a file part among them, is a 400 that names it. Approval and mcp items
are not messages: the model never reads them (it reads the answers they led to).
"""

from __future__ import annotations

from typing import Any

from serving.http.problems import bad_request
from serving.http.schemas import ChatMessageIn, FunctionCallIn, ToolCallIn

_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"type", "call_id", "output", "id", "status"},
              "mcp_approval_request": {"type", "id", "name", "arguments", "server_label"},
              "mcp_approval_response": {"type", "approval_request_id", "approve", "id", "reason"},
              "mcp_list_tools": {"type", "id", "server_label", "tools", "error"},
              "mcp_call": {"type", "id", "server_label", "name", "arguments", "output", "error", "status",
                           "approval_request_id"}}
_PART_KEYS = {"type", "text", "annotations", "logprobs"}
_ROLES = ("user", "assistant", "system", "developer")


def input_items(value: str | list[Any]) -> list[dict[str, Any]]:
    """``input`` as conversation items (``message`` with text content, ``function_call``,
    ``function_call_output``); a 400 naming the bad item otherwise."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not value:
        raise bad_request("input: give a string or a list of at least one item", "input")
    return [_item(item, f"input[{index}]") for index, item in enumerate(value)]


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise bad_request(f"{where}: expected an item object (a message, function_call or function_call_output)",
                          "input")
    kind = item.get("type", "message")
    keys = _ITEM_KEYS.get(kind) if isinstance(kind, str) else None
    if keys is None:
        raise bad_request(f"{where}.type: {kind!r} items are not supported by this server (message, function_call, "
                          "function_call_output and the mcp_ items of an earlier response are)", "input")
    if unknown := sorted(set(item) - keys):
        raise bad_request(f"{where}: {', '.join(unknown)}: not supported by this server in a {kind} item", "input")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role: expected one of {', '.join(_ROLES)}, got {role!r}", "input")
        return {"type": kind, "role": role, "content": _content(item.get("content"), f"{where}.content")}
    if kind == "mcp_approval_response":
        if not isinstance(item.get("approval_request_id"), str) or not isinstance(item.get("approve"), bool):
            raise bad_request(f"{where}: an mcp_approval_response needs approval_request_id (a string) and approve "
                              "(true or false)", "input")
        return {"type": kind, "approval_request_id": item["approval_request_id"], "approve": item["approve"]}
    if kind in ("mcp_list_tools", "mcp_call"):  # what an earlier response's tools did, sent back: not read
        if not isinstance(item.get("server_label"), str):
            raise bad_request(f"{where}.server_label: expected a string", "input")
        return dict(item)
    names = {"function_call": ("call_id", "name", "arguments"), "function_call_output": ("call_id", "output"),
             "mcp_approval_request": ("id", "name", "arguments", "server_label")}[kind]
    for name in names:
        if not isinstance(item.get(name), str):
            raise bad_request(f"{where}.{name}: expected a string", "input")
    return {"type": kind, **{name: item[name] for name in names}}


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: expected a string or a list of input_text parts", "input")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text"):
            raise bad_request(f"{where}[{index}]: {kind or 'this part'} is not supported by this server (text only: "
                              "input_text or output_text parts)", "input")
        if unknown := sorted(set(part) - _PART_KEYS):
            raise bad_request(f"{where}[{index}]: {', '.join(unknown)}: not supported by this server", "input")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{index}].text: expected a string", "input")
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(items: list[dict[str, Any]]) -> list[ChatMessageIn]:
    """Conversation items as chat messages: a function call joins the assistant turn before it."""
    messages: list[ChatMessageIn] = []
    for item in items:
        if item["type"] == "message":
            messages.append(ChatMessageIn(role=item["role"], content=item["content"]))
        elif item["type"] == "function_call":
            call = ToolCallIn(id=item["call_id"], function=FunctionCallIn(name=item["name"],
                                                                          arguments=item["arguments"]))
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                messages.append(ChatMessageIn(role="assistant", tool_calls=[call]))
        elif item["type"] == "function_call_output":
            messages.append(ChatMessageIn(role="tool", content=item["output"], tool_call_id=item["call_id"]))
    return messages
