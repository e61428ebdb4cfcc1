"""The ``ToolProvider`` that ``agent`` steps run their tools through: MCP servers and HTTP endpoints.

Built from ``inferline.yaml`` (``mcp_servers:``, ``tool_headers:``); counts every call by tool and outcome in
``inferline_tool_calls_total{tool, outcome}`` on the app's ``/metrics`` registry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from sqlalchemy.exc import SQLAlchemyError

from pipeline.errors import BackendError
from pipeline.protocols import ToolReply, ToolSchema
from serving.backends.http_tools import HttpTools
from serving.backends.mcp_client import McpConnection
from serving.config.server import ServerSpec
from store.pipeline_versions import ToolPins


class ToolHub:
    """Every tool the server's pipelines may run (see the module docstring)."""

    def __init__(self, server: ServerSpec, root: Path, registry: CollectorRegistry | None = None):
        self._http = HttpTools(server.tool_headers, root)
        self._mcp = {name: McpConnection(name, spec, root, lambda spec=spec: self._http.headers(spec.headers_from))
                     for name, spec in server.mcp_servers.items()}
        #: Where pins are kept with their pipeline versions (set once the database is open).
        self.pins: ToolPins | None = None
        self._calls = Counter("inferline_tool_calls", "Tool calls of agent steps, by tool and outcome (ok, error, "
                              "timeout, refused, pending, denied).", ["tool", "outcome"],
                              registry=registry if registry is not None else CollectorRegistry())

    def _server(self, name: str) -> McpConnection:
        connection = self._mcp.get(name)
        if connection is None:
            raise BackendError(f"no MCP server {name!r} in mcp_servers: of inferline.yaml")
        return connection

    async def list_mcp(self, server: str) -> Mapping[str, ToolSchema]:
        return await self._server(server).tools()

    async def call_mcp(self, server: str, tool: str, arguments: Mapping[str, Any]) -> ToolReply:
        return await self._server(server).call(tool, arguments)

    async def call_http(self, method: str, url: str, arguments: Mapping[str, Any], headers_from: str | None,
                        max_response_bytes: int) -> ToolReply:
        return await self._http.call(method, url, arguments, headers_from, max_response_bytes)

    def count(self, tool: str, outcome: str) -> None:
        self._calls.labels(tool, outcome).inc()

    async def pin(self, pipeline: str, spec_sha256: str, pins: Mapping[str, str]) -> Mapping[str, str]:
        if self.pins is None:
            return pins
        try:
            return await asyncio.to_thread(self.pins.pin, pipeline, spec_sha256, pins)
        except SQLAlchemyError as exc:  # the version's pins cannot be read: its tools are not offered yet
            raise BackendError(f"the pins of pipeline {pipeline!r}'s MCP tools cannot be read (the database: "
                               f"{type(exc).__name__}); retry") from None

    async def aclose(self) -> None:
        for connection in self._mcp.values():
            await connection.aclose()
        await self._http.aclose()
