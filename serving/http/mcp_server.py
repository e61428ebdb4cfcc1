"""The MCP server behind ``/mcp`` and its sessions (the ``mcp`` package's streamable HTTP server side).

:class:`McpSessions` knows the protocol, not the pipelines: what ``tools/list`` and ``tools/call`` answer
is given to it (serving/http/mcp_routes.py), each handed the app's request that carried the message, so
that the caller's key is read from its headers as on every route. It binds each session to the key that
opened it, and tells open sessions when the tools change: 2026-07-28 clients on the
``subscriptions/listen`` streams they open, older ones on the standing GET stream of each session that
has listed the tools.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from weakref import WeakSet

import mcp_types as types
from litestar import Request
from litestar.types import Receive, Scope, Send
from mcp.server import NotificationOptions, Server, ServerRequestContext
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.connection import Connection
from mcp.server.models import InitializationOptions
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from pipeline import __version__
from serving.http.auth import Authenticator
from serving.http.problems import Problem, title_for

logger = logging.getLogger(__name__)

#: What answers ``tools/list`` for the request that carried it.
ListTools = Callable[[Request[Any, Any, Any]], Awaitable[list[types.Tool]]]
#: What answers ``tools/call`` (the tool's name, its arguments) for the request that carried it.
CallTool = Callable[[Request[Any, Any, Any], str, dict[str, Any]], Awaitable[types.CallToolResult]]

#: The ``Connection.state`` key of a handshake-era session that is told when the tools change.
_TOLD = "inferline.tools_changed"


class ToolServer(Server[Any]):
    """An MCP server of tools only, whose list changes: it says so in its capabilities (handshake-era
    sessions are told on their GET stream; later ones through ``subscriptions/listen``, which it serves)."""

    def __init__(self, list_tools: ListTools, call_tool: CallTool, bus: InMemorySubscriptionBus) -> None:
        super().__init__("inferline", version=__version__, title="Inferline",
                         instructions="Each tool runs one of the pipelines this API key may call.",
                         on_list_tools=self._list_tools, on_call_tool=self._call_tool,
                         on_subscriptions_listen=ListenHandler(bus))
        self.list_tools = list_tools
        self.call_tool = call_tool
        #: Handshake-era connections that have listed the tools: told on their GET stream when they change.
        self.listing: WeakSet[Connection] = WeakSet()

    def create_initialization_options(self, notification_options: NotificationOptions | None = None,
                                      experimental_capabilities: dict[str, dict[str, Any]] | None = None,
                                      extensions: dict[str, dict[str, Any]] | None = None) -> InitializationOptions:
        return super().create_initialization_options(notification_options or NotificationOptions(tools_changed=True),
                                                     experimental_capabilities, extensions)

    async def _list_tools(self, ctx: ServerRequestContext[Any, Any],
                          params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        tools = await self.list_tools(_request_of(ctx))
        self._follow(ctx)
        return types.ListToolsResult(tools=tools)

    async def _call_tool(self, ctx: ServerRequestContext[Any, Any],
                         params: types.CallToolRequestParams) -> types.CallToolResult:
        return await self.call_tool(_request_of(ctx), params.name, dict(params.arguments or {}))

    def _follow(self, ctx: ServerRequestContext[Any, Any]) -> None:
        """Tell this handshake-era session when the tools change (a 2026-07-28 one listens for that)."""
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            return
        # The SDK hands lowlevel handlers a per-request proxy of the session; its connection is the session.
        connection: Connection = ctx.session._connection
        if connection.session_id is None or connection.state.get(_TOLD):
            return  # stateless: there is no GET stream to tell it on
        connection.state[_TOLD] = True
        self.listing.add(connection)
        connection.exit_stack.callback(self.listing.discard, connection)


def _request_of(ctx: ServerRequestContext[Any, Any]) -> Request[Any, Any, Any]:
    """The app's request that carried this MCP message (its headers hold the caller's key)."""
    if ctx.request is None:
        raise MCPError(types.INTERNAL_ERROR, "no HTTP request carried this message")
    return Request(ctx.request.scope)


class McpSessions:
    """The MCP server of ``/mcp`` and its open sessions: run by the app's lifespan (:meth:`serve`), told of
    changed tools by the pipelines' reloader (:meth:`tools_changed`)."""

    def __init__(self, auth: Authenticator, max_body_bytes: int, list_tools: ListTools, call_tool: CallTool) -> None:
        self.auth = auth
        self.max_body_bytes = max_body_bytes
        self.bus = InMemorySubscriptionBus()
        self.server = ToolServer(list_tools, call_tool, self.bus)
        # Without auth (loopback only) a web page could reach /mcp by rebinding a name of its own to
        # 127.0.0.1: only loopback hosts and origins are answered then. With auth, the key decides.
        security = None if auth.enabled else TransportSecuritySettings(
            enable_dns_rebinding_protection=True, allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"])
        self.manager = StreamableHTTPSessionManager(self.server, security_settings=security,
                                                    max_request_body_size=max_body_bytes)
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, started: asyncio.Future[None]) -> None:
        """Run the sessions until cancelled. The lifespan runs this as a task of its own: the manager's
        task group must be left by the task that entered it, whichever task opened the app's resources."""
        async with self.manager.run():
            started.set_result(None)
            await asyncio.Event().wait()

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One HTTP request to ``/mcp``: a 401 problem without a valid key, a 413 problem for a body over
        ``http.max_body_bytes`` (both recorded as every route's refusals are), else the MCP transport's answer."""
        principal = await self.auth.principal(Request(scope))
        if principal is not None:  # a session answers only the key that opened it
            scope["user"] = AuthenticatedUser(AccessToken(  # type: ignore[typeddict-unknown-key]
                token=principal.key_id, client_id=principal.key_id, scopes=[principal.role]))
        if scope.get("method") == "POST":
            receive = await self._bounded(scope, receive)
        await self.manager.handle_request(scope, receive, send)  # type: ignore[arg-type]

    async def _bounded(self, scope: Scope, receive: Receive) -> Receive:
        """A POST's body read whole, within ``http.max_body_bytes`` (a JSON-RPC message is read whole by the
        transport anyway), and handed on; a 413 problem past the limit, declared or sent."""
        too_large = Problem(413, title_for(413), f"the body is over http.max_body_bytes ({self.max_body_bytes} "
                            "bytes)", "body_too_large")
        declared = Request(scope).headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        chunks, size, message = [], 0, await receive()
        while message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise too_large
            if not message.get("more_body"):
                break
            message = await receive()
        if message["type"] != "http.request":  # the client left: the transport sees it leave
            first = message
        else:
            first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        handed = False

        async def replay() -> Any:
            nonlocal handed
            if handed:
                return await receive()
            handed = True
            return first

        return replay

    def tools_changed(self) -> None:
        """Tell the open sessions that the tools changed (returns at once; they are told by a task)."""
        task = asyncio.get_running_loop().create_task(self._announce())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _announce(self) -> None:
        await self.bus.publish(ToolsListChanged())
        for connection in list(self.server.listing):
            try:
                await connection.send_tool_list_changed()
            except Exception as exc:  # a session that went away meanwhile: the others are still told
                logger.debug("mcp: session %s not told of changed tools: %s", connection.session_id, exc)
