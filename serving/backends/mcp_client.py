"""Connections to the MCP servers of ``inferline.yaml`` (``mcp_servers:``), for the ``agent`` step's tools.

One :class:`McpConnection` per server, opened on first use and kept open by a task of its own (the ``mcp``
client's streams live in task groups that must be entered and left by one task), reopened after the server
goes away. Requests of any task go through it. A stdio server (``command:``) is a child process of this one;
a streamable HTTP server (``url:``) gets the header set the config names and nothing else, so a caller's
bearer token never reaches it. The tools a server lists are kept for ``schema_ttl_s`` and listed again after
(at once after its ``notifications/tools/list_changed``);
each carries the SHA-256 of its schema (:func:`schema_sha256`), which the step compares with the one it
pinned when its pipeline version loaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import ListenNotSupportedError

from pipeline.errors import BackendError
from pipeline.protocols import ToolReply, ToolSchema
from serving.config.server import McpServerSpec

logger = logging.getLogger(__name__)


def schema_sha256(description: str, parameters: Mapping[str, Any]) -> str:
    """The SHA-256 of a tool's definition as the model sees it: its description and its arguments' schema
    (canonical JSON): a change to either is a new tool, which a pinned version refuses."""
    text = json.dumps({"description": description, "parameters": parameters}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class McpConnection:
    """One MCP server, connected on first use (see the module docstring)."""

    def __init__(self, name: str, spec: McpServerSpec, root: Path, headers: Callable[[], dict[str, str]]):
        self.name = name
        self.spec = spec
        self._root = root
        self._headers = headers
        self._client: Client | None = None
        self._owner: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._lock = asyncio.Lock()
        self._tools: dict[str, ToolSchema] = {}
        self._listed_at = float("-inf")

    async def tools(self) -> dict[str, ToolSchema]:
        """The server's tools by name, listed again once ``schema_ttl_s`` has passed (on a new connection when
        the old one fails: a server restarted, perhaps with other tools)."""
        if time.monotonic() - self._listed_at > self.spec.schema_ttl_s:
            try:
                listed = await (await self._connected()).list_tools()
            except Exception as exc:
                if isinstance(exc, BackendError):
                    raise
                logger.info("MCP server %s: listing failed (%s); connecting again", self.name, exc)
                await self._drop()
                listed = await (await self._connected()).list_tools()
            self._tools = {tool.name: ToolSchema(tool.name, tool.description or "", dict(tool.input_schema),
                                                 schema_sha256(tool.description or "", tool.input_schema))
                           for tool in listed.tools}
            self._listed_at = time.monotonic()
        return self._tools

    async def call(self, tool: str, arguments: Mapping[str, Any]) -> ToolReply:
        """Call *tool*; a cancellation of the awaiting task reaches the server as ``notifications/cancelled``."""
        client = await self._connected()
        result = await client.call_tool(tool, dict(arguments))
        texts = [getattr(part, "text", None) for part in result.content]
        text = "\n".join(t for t in texts if t is not None)
        if not text and result.structured_content is not None:
            text = json.dumps(result.structured_content, ensure_ascii=False)
        return ToolReply(text, bool(result.is_error))

    async def aclose(self) -> None:
        await self._drop()

    async def _drop(self) -> None:
        """Close the connection (a stdio server's process with it); the next use opens a new one."""
        owner, self._owner, self._client = self._owner, None, None
        self._closing.set()
        if owner is not None:
            try:
                await asyncio.wait_for(asyncio.shield(owner), 5)
            except (TimeoutError, Exception):  # a server that will not stop is killed with its task
                owner.cancel()
        self._closing = asyncio.Event()

    async def _connected(self) -> Client:
        if self._client is not None and self._owner is not None and not self._owner.done():
            return self._client
        async with self._lock:
            if self._client is None or self._owner is None or self._owner.done():
                self._client = None
                self._listed_at = float("-inf")
                ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
                self._owner = asyncio.create_task(self._hold(ready, self._closing), name=f"mcp:{self.name}")
                self._client = await ready
        return self._client

    async def _hold(self, ready: asyncio.Future[Client], closing: asyncio.Event) -> None:
        """Open the connection, hand it over, and keep it until :meth:`aclose` (or the server leaves)."""
        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(Client(self._transport(stack),
                                                                message_handler=self._on_message))
                ready.set_result(client)
                await self._follow_changes(client, closing)
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(BackendError(f"MCP server {self.name!r}: cannot connect: {exc}"))
            elif not isinstance(exc, asyncio.CancelledError):
                logger.warning("MCP server %s: connection lost: %s", self.name, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _follow_changes(self, client: Client, closing: asyncio.Event) -> None:
        """Until *closing*: have the tools listed again whenever the server says they changed, through a
        ``subscriptions/listen`` stream where the protocol has one (2026-07-28), else through the notification
        older servers send unasked (:meth:`_on_message`)."""
        try:
            async with client.listen(tools_list_changed=True) as changes:
                async def forget() -> None:
                    try:
                        async for _ in changes:
                            self._listed_at = float("-inf")
                    except Exception as exc:  # the stream is gone, and perhaps the server: list before trusting
                        logger.info("MCP server %s: change stream ended: %s", self.name, exc)
                    self._listed_at = float("-inf")

                follower = asyncio.create_task(forget())
                try:
                    await closing.wait()
                finally:
                    follower.cancel()
        except ListenNotSupportedError:
            await closing.wait()

    async def _on_message(self, message: Any) -> None:
        """A server's notification: ``tools/list_changed`` has the tools listed again before the next call."""
        method = getattr(message, "method", None) or getattr(getattr(message, "root", None), "method", None)
        if method == "notifications/tools/list_changed":
            self._listed_at = float("-inf")
        elif isinstance(message, Exception):
            logger.info("MCP server %s: %s", self.name, message)

    def _transport(self, stack: AsyncExitStack) -> Any:
        spec = self.spec
        if spec.command is not None:
            command, *args = spec.command
            command = sys.executable if command == "python" else command  # this server's own interpreter
            return StdioServerParameters(command=command, args=args, env={**_passed_env(), **spec.env},
                                         cwd=str(self._root))
        # The SDK's own defaults: a server may hold a response stream open for minutes.
        http = httpx2.AsyncClient(headers=self._headers(), timeout=httpx2.Timeout(30.0, read=300.0))
        stack.push_async_callback(http.aclose)
        return streamable_http_client(str(spec.url), http_client=http)


def _passed_env() -> dict[str, str]:
    """What a stdio server inherits of this process's environment: where to find programs, never secrets."""
    return {key: os.environ[key] for key in ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV")
            if key in os.environ}
