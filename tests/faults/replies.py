"""Helpers of the fault tests: streamed requests read as SSE, and the audit log read back from SQL.

Every request's input is unique, and the chat pipeline's audit stage stores its SHA-256
(``content: hash``), so records are matched to the requests that made them one for one.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import sqlalchemy as sa

from store.engine import make_engine


@dataclass
class Reply:
    """One streamed request as its client saw it."""

    input: str
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    body: str = ""
    transport_error: str | None = None
    left_early: bool = False

    @property
    def done(self) -> dict[str, Any] | None:
        return next((data for kind, data in self.events if kind == "done"), None)

    @property
    def error(self) -> dict[str, Any] | None:
        return next((data for kind, data in self.events if kind == "error"), None)

    @property
    def text(self) -> str:
        return "".join(data["text"] for kind, data in self.events if kind == "delta")


async def post_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], *,
                      leave_after_lines: int | None = None) -> Reply:
    """POST *body* with ``"stream": true``; read its events (or leave after *leave_after_lines* lines)."""
    reply = Reply(str(body.get("input", "")))
    event = ""
    try:
        async with client.stream("POST", path, json={**body, "stream": True}) as response:
            reply.status = response.status_code
            reply.headers = dict(response.headers)
            if response.status_code != 200:
                reply.body = (await response.aread()).decode(errors="replace")
                return reply
            lines = 0
            async for line in response.aiter_lines():
                lines += 1
                if leave_after_lines is not None and lines > leave_after_lines:
                    reply.left_early = True
                    return reply  # closing the response here is the disconnect
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    reply.events.append((event, json.loads(line[5:])))
    except httpx.HTTPError as exc:
        reply.transport_error = f"{type(exc).__name__}: {exc}"
    return reply


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def audit_rows(url: str, pipelines: Iterable[str]) -> list[dict[str, Any]]:
    """Every audit record of *pipelines* in the database at *url*."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            statement = sa.text("SELECT id, input_content, status, http_status, error_type, pipeline, route "
                                "FROM audit_records WHERE kind = 'record' AND pipeline IN :names"
                                ).bindparams(sa.bindparam("names", expanding=True))
            return [dict(row) for row in conn.execute(statement, {"names": list(pipelines)}).mappings()]
    finally:
        engine.dispose()


def records_by_input(rows: Iterable[dict[str, Any]]) -> Counter[str]:
    """How many records each input hash has."""
    return Counter(row["input_content"] for row in rows)
