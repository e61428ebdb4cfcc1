"""The reviewers' API: query, read, summarize, verify and export the audit log.

Only ``auditor`` and ``admin`` keys may call these routes, and every call is
itself written to the access log (who asked what, when).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from litestar import Request, get
from litestar.params import FromPath, FromQuery, QueryParameter
from litestar.response import Response, Stream

from pipeline.context import Principal
from serving.api_docs import JsonLinesOrCsv, problems
from serving.problems import Problem
from serving.state import AppState
from store.audit import AuditFilters, AuditStore
from store.audit_query import MAX_LIMIT, SORT_FIELDS

_ROLES = ("auditor",)
# Documented for clients, checked by the store (a value outside them is its 400, naming what is allowed).
_Sort = Annotated[str, QueryParameter(schema_extra={"enum": [f"{sign}{name}" for name in SORT_FIELDS
                                                            for sign in ("", "-")]})]
_Limit = Annotated[int, QueryParameter(schema_extra={"minimum": 1, "maximum": MAX_LIMIT})]


async def _reviewer(request: Request, action: str, query: dict[str, Any]) -> tuple[AuditStore, Principal | None]:
    state = AppState.of(request)
    principal = await state.auth.authorize(request, _ROLES, "read the audit log")
    store = state.audit
    if store is None:
        raise Problem(503, "Backend unavailable", "the audit store is not open", "backend_error")
    clean = {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in query.items() if v is not None}
    await asyncio.to_thread(store.log_access, principal.key_id if principal else None,
                            principal.role if principal else None, action, clean)
    await state.audit_read_barrier()
    return store, principal


def _utc(name: str, value: datetime | None) -> datetime | None:
    """*value* in UTC (without an offset it is taken as UTC); a 400 when it has no UTC equivalent
    (``0001-01-01T00:00+01:00`` is in year 0 there)."""
    if value is None:
        return None
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:
        raise Problem(400, "Bad request", f"{name}: {value.isoformat()} is out of range in UTC",
                      "invalid_query") from None


def _filters(since: datetime | None, until: datetime | None, pipeline: str | None, spec_sha256: str | None,
             key_id: str | None, model: str | None, policy_action: str | None, policy_category: str | None,
             status: str | None, finish_reason: str | None, min_cost_usd: float | None,
             text: str | None) -> AuditFilters:
    return AuditFilters(since=_utc("since", since), until=_utc("until", until), pipeline=pipeline,
                        spec_sha256=spec_sha256, key_id=key_id,
                        model=model, policy_action=policy_action, policy_category=policy_category, status=status,
                        finish_reason=finish_reason, min_cost_usd=min_cost_usd, text=text)


async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except ValueError as exc:  # the store's word for a bad sort, cursor or filter
        raise Problem(400, "Bad request", str(exc), "invalid_query") from exc


@get("/audit/records", summary="Query audit records (filters, sorting, cursor pagination)", tags=["audit"],
     responses=problems(400, 401, 403, 422, 503))
async def records(request: Request, since: FromQuery[datetime | None] = None,
                  until: FromQuery[datetime | None] = None, pipeline: FromQuery[str | None] = None,
                  spec_sha256: FromQuery[str | None] = None, key_id: FromQuery[str | None] = None,
                  model: FromQuery[str | None] = None, policy_action: FromQuery[str | None] = None,
                  policy_category: FromQuery[str | None] = None, status: FromQuery[str | None] = None,
                  finish_reason: FromQuery[str | None] = None, min_cost_usd: FromQuery[float | None] = None,
                  text: FromQuery[str | None] = None, sort: _Sort = "-received_at",
                  cursor: FromQuery[str | None] = None, limit: _Limit = 50) -> dict[str, Any]:
    filters = _filters(since, until, pipeline, spec_sha256, key_id, model, policy_action, policy_category, status,
                       finish_reason, min_cost_usd, text)
    logged = {f: getattr(filters, f) for f in filters.__dataclass_fields__ if getattr(filters, f) is not None}
    store, _ = await _reviewer(request, "query", {**logged, "sort": sort, "cursor": cursor, "limit": limit})
    page = await _call(store.query, filters, sort=sort, cursor=cursor, limit=limit)
    return {"records": page.records, "next_cursor": page.next_cursor}


@get("/audit/records/{record_id:str}", summary="One audit record with its stages", tags=["audit"],
     responses=problems(400, 401, 403, 404, 503))
async def record(request: Request, record_id: FromPath[str]) -> dict[str, Any]:
    store, _ = await _reviewer(request, "show", {"record_id": record_id})
    found = await _call(store.get, record_id)
    if found is None:
        raise Problem(404, "Not found", f"no audit record {record_id!r}", "record_not_found")
    return found


@get("/audit/summary", summary="Counts, block rate, tokens and cost, grouped", tags=["audit"],
     responses=problems(400, 401, 403, 422, 503))
async def summary(request: Request, group_by: FromQuery[Literal["pipeline", "model", "key_id", "day"]] = "pipeline",
                  since: FromQuery[datetime | None] = None, until: FromQuery[datetime | None] = None,
                  pipeline: FromQuery[str | None] = None) -> dict[str, Any]:
    store, _ = await _reviewer(request, "summary", {"group_by": group_by, "since": since, "until": until,
                                                    "pipeline": pipeline})
    filters = AuditFilters(since=_utc("since", since), until=_utc("until", until), pipeline=pipeline)
    return {"group_by": group_by, "groups": await _call(store.summary, filters, group_by)}


@get("/audit/verify", summary="Recompute the hash chain and report any tampering", tags=["audit"],
     responses=problems(400, 401, 403, 422, 503))
async def verify(request: Request, since: FromQuery[datetime | None] = None,
                 until: FromQuery[datetime | None] = None) -> dict[str, Any]:
    store, _ = await _reviewer(request, "verify", {"since": since, "until": until})
    report = await _call(store.verify, _utc("since", since), _utc("until", until))
    return {"ok": report.ok, "checked": report.checked, "head_seq": report.head_seq,
            "findings": [{"kind": f.kind, "seq": f.seq, "record_id": f.record_id, "detail": f.detail}
                         for f in report.findings]}


@get("/audit/export", summary="Export records as JSON Lines or CSV, streamed", tags=["audit"],
     operation_class=JsonLinesOrCsv, responses=problems(400, 401, 403, 422, 503))
async def export(request: Request, format: FromQuery[Literal["jsonl", "csv"]] = "jsonl",
                 since: FromQuery[datetime | None] = None, until: FromQuery[datetime | None] = None,
                 pipeline: FromQuery[str | None] = None, status: FromQuery[str | None] = None) -> Response[Any]:
    store, _ = await _reviewer(request, "export", {"format": format, "since": since, "until": until,
                                                   "pipeline": pipeline, "status": status})
    filters = AuditFilters(since=_utc("since", since), until=_utc("until", until), pipeline=pipeline, status=status)
    lines = store.export(filters, format)
    media = "application/x-ndjson" if format == "jsonl" else "text/csv"
    return Stream(_async_lines(lines), media_type=media,
                  headers={"Content-Disposition": f'attachment; filename="audit.{format}"'})


async def _async_lines(lines: Iterator[str]) -> AsyncIterator[bytes]:
    # The store's export is a blocking generator: pull each batch of lines off the event loop.
    sentinel = object()
    while (line := await asyncio.to_thread(next, lines, sentinel)) is not sentinel:
        yield line.encode() if isinstance(line, str) else line


ROUTES = [records, record, summary, verify, export]
