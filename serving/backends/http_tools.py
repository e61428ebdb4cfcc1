"""HTTP tools of ``agent`` steps: one request per call, with the server's headers only.

The URL is a template whose ``{name}`` fields are arguments, each percent-encoded whole (``/`` included),
so that an argument can never leave its path segment (``../admin``) or add a query. The other arguments go
in the query string (GET, DELETE) or as the JSON body (POST, PUT, PATCH). The headers are the named set of
``tool_headers:`` in ``inferline.yaml``, read from the environment or a secrets file at each call; nothing of
the caller's request is sent. A body longer than ``max_response_bytes`` is an error, not a cut answer.
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from pipeline.errors import BackendError
from pipeline.protocols import ToolReply
from serving.config.server import HeaderValue

#: Methods whose arguments travel as the query string; the others send a JSON body.
QUERY_METHODS = frozenset({"GET", "DELETE"})


def url_fields(template: str) -> list[str]:
    """The argument names a URL template uses."""
    return [field for _, field, _, _ in string.Formatter().parse(template) if field]


def render_url(template: str, arguments: Mapping[str, Any]) -> str:
    """*template* with each ``{name}`` replaced by its argument, percent-encoded whole."""
    fields = url_fields(template)
    missing = [name for name in fields if name not in arguments]
    if missing:
        raise BackendError(f"the URL needs the argument(s) {', '.join(missing)}")
    return template.format_map({name: quote(str(arguments[name]), safe="") for name in fields})


def read_headers(headers: Mapping[str, HeaderValue], root: Path) -> dict[str, str]:
    """The values of a header set, read now; a missing variable or file is an error that names it."""
    values = {}
    for name, source in headers.items():
        if source.env is not None:
            value = os.environ.get(source.env)
            if value is None:
                raise BackendError(f"header {name}: the environment variable {source.env} is not set")
        else:
            path = root / str(source.file)
            try:
                value = path.read_text(encoding="utf-8").rstrip("\n")
            except OSError as exc:
                raise BackendError(f"header {name}: cannot read {path}: {exc.strerror or exc}") from None
        values[name] = value
    return values


class HttpTools:
    """Makes the HTTP tools' requests over one connection pool."""

    def __init__(self, header_sets: Mapping[str, Mapping[str, HeaderValue]], root: Path):
        self._header_sets = header_sets
        self._root = root
        # Never the environment's proxies or .netrc credentials: a tool gets exactly the headers it is given.
        self._client = httpx.AsyncClient(trust_env=False, follow_redirects=False)

    def headers(self, name: str | None) -> dict[str, str]:
        if name is None:
            return {}
        if name not in self._header_sets:
            raise BackendError(f"no header set {name!r} in tool_headers: of inferline.yaml")
        return read_headers(self._header_sets[name], self._root)

    async def call(self, method: str, url: str, arguments: Mapping[str, Any], headers_from: str | None,
                   max_response_bytes: int) -> ToolReply:
        rest = {k: v for k, v in arguments.items() if k not in set(url_fields(url))}
        target = render_url(url, arguments)
        method = method.upper()
        query = {k: v if isinstance(v, str) else json.dumps(v) for k, v in rest.items()} \
            if method in QUERY_METHODS else None
        body = None if method in QUERY_METHODS else rest
        request = self._client.build_request(method, target, params=query, json=body,
                                             headers=self.headers(headers_from))
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise BackendError(f"{method} {request.url.copy_with(query=None)}: {exc}") from None
        try:
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > max_response_bytes:
                    raise BackendError(f"the response is longer than max_response_bytes ({max_response_bytes})")
        finally:
            await response.aclose()
        text = data.decode("utf-8", errors="replace")
        return ToolReply(text, response.status_code >= 400)

    async def aclose(self) -> None:
        await self._client.aclose()
