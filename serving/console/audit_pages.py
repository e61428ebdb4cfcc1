"""The audit explorer: the audit API's filters, a paged table, a record's detail, chain verification,
exports and the reviewers' access log, for ``auditor`` and ``admin`` keys (a caller gets a 403 page).

It reads the same store as ``/audit/*`` and, like the API, writes every read to the access log
(with ``"via": "console"`` in the logged query). Filters come from a plain GET form, so a filtered
table is a link a reviewer can share; verification is a POST with the form's CSRF token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from litestar import Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.response import Response, Stream

from serving.console.render import SECURITY_HEADERS
from serving.console.session import CSRF_FIELD, Session
from serving.console.state import Console
from serving.console.trace_view import from_record
from serving.http.audit_params import access_filters, audit_filters, refuse_unknown_query
from serving.http.audit_routes import spec_of
from serving.http.problems import Problem
from store.audit import (
    ACCESS_FIELDS,
    FILTER_FIELDS,
    MAX_LIMIT,
    SORT_FIELDS,
    STATUSES,
    AccessFilters,
    AuditFilters,
    AuditReader,
)
from store.audit import parse_time as store_parse_time

_ROLES = ("auditor",)
_WHAT = "read the audit log"
FILTER_NAMES = tuple(FILTER_FIELDS)
SORTS = tuple(s for name in SORT_FIELDS for s in (f"-{name}", name))
POLICY_ACTIONS = ("allow", "flag", "redact", "block")
#: The pages' filters are the API's (serving/http/audit_params.py): the same dependency parses them, and the
#: same guard refuses a query parameter a page does not take.
_GUARDED = {"guards": [refuse_unknown_query]}


def echo_of(params: Mapping[str, str], names: tuple[str, ...] = FILTER_NAMES) -> dict[str, str]:
    """The filters as given, to put back in the form (empty fields are unset)."""
    return {name: (params.get(name) or "").strip()[:500] for name in names}


def parse_time(name: str, value: str | None) -> datetime | None:
    """A time from a form (ISO 8601, without an offset in UTC, or relative: 24h, 7d, yesterday); empty is
    None; anything else is a 400."""
    if value is None or not value.strip():
        return None
    try:
        return store_parse_time(value)
    except ValueError as exc:
        raise Problem(400, "Bad request", f"{name}: {exc}", "invalid_query") from None


def parse_limit(value: str | None, default: int = 25) -> int:
    if value is None or not value.strip():
        return default
    if not value.strip().isdigit() or not 1 <= int(value) <= MAX_LIMIT:
        raise Problem(400, "Bad request", f"limit must be a whole number from 1 to {MAX_LIMIT}", "invalid_query")
    return int(value)


async def reviewer(console: Console, request: Request, action: str, query: Mapping[str, Any],
                   session: Session | None = None) -> tuple[AuditReader, Session]:
    """The store's reader, for a reviewer's session, with this read written to the access log (as the API does)."""
    session = session or await console.session(request, _ROLES, _WHAT)
    reader = console.services.audit.reader
    principal = session.principal
    logged = {k: v for k, v in query.items() if v not in (None, "")} | {"via": "console"}
    await asyncio.to_thread(reader.log_access, principal.key_id if principal else None,
                            principal.role if principal else None, action, logged)
    await console.services.audit_read_barrier()
    return reader, session


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a blocking store call off the loop; its ValueError (a bad sort, cursor, filter) is a 400."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except ValueError as exc:
        raise Problem(400, "Bad request", str(exc), "invalid_query") from exc


@get("/audit", name="console-audit", dependencies={"filters": audit_filters}, **_GUARDED)
async def audit_page(request: Request, filters: NamedDependency[AuditFilters], sort: FromQuery[str | None] = None,
                     limit: FromQuery[str | None] = None, cursor: FromQuery[str | None] = None) -> Response[str]:
    """The filtered, sorted, paged table of audit records."""
    console = Console.of(request)
    echo = echo_of(request.query_params)
    sort = sort or "-received_at"
    if sort not in SORTS:
        raise Problem(400, "Bad request", f"cannot sort by {sort!r}; choose one of {', '.join(SORTS)}",
                      "invalid_query")
    page_size, cursor = parse_limit(limit), cursor or None
    store, session = await reviewer(console, request, "query", {**echo, "sort": sort, "cursor": cursor,
                                                                "limit": page_size})
    page = await call(store.query, filters, sort=sort, cursor=cursor, limit=page_size)
    kept = {k: v for k, v in {**echo, "sort": sort, "limit": str(page_size)}.items() if v}
    exports = {fmt: "/ui/audit/export?" + urlencode({**{k: v for k, v in echo.items() if v}, "format": fmt})
               for fmt in ("jsonl", "csv")}
    return console.page(request, session, "audit.html", records=page.records, filters=echo, sort=sort,
                        limit=page_size, sorts=SORTS, statuses=STATUSES, policy_actions=POLICY_ACTIONS,
                        pipelines=sorted(console.services.executor.pipelines), is_first_page=cursor is None,
                        next_url=("/ui/audit?" + urlencode({**kept, "cursor": page.next_cursor})
                                  if page.next_cursor else None),
                        first_url="/ui/audit?" + urlencode(kept), exports=exports)


@get("/audit/access", name="console-audit-access", dependencies={"filters": access_filters}, **_GUARDED)
async def access_page(request: Request, filters: NamedDependency[AccessFilters], limit: FromQuery[str | None] = None,
                      cursor: FromQuery[str | None] = None) -> Response[str]:
    """The reviewers' access log: who read the audit log, how and when, newest first."""
    console = Console.of(request)
    echo = echo_of(request.query_params, tuple(ACCESS_FIELDS))
    page_size, cursor = parse_limit(limit, 50), cursor or None
    store, session = await reviewer(console, request, "access", {**echo, "cursor": cursor, "limit": page_size})
    page = await call(store.access, filters, cursor=cursor, limit=page_size)
    kept = {k: v for k, v in {**echo, "limit": str(page_size)}.items() if v}
    return console.page(request, session, "access.html", entries=page.records, filters=echo,
                        limit=page_size, is_first_page=cursor is None,
                        next_url=("/ui/audit/access?" + urlencode({**kept, "cursor": page.next_cursor})
                                  if page.next_cursor else None),
                        first_url="/ui/audit/access?" + urlencode(kept))


@get("/audit/records/{record_id:str}", name="console-audit-record", **_GUARDED)
async def record_page(request: Request, record_id: FromPath[str]) -> Response[str]:
    """One record: who, what, the content as stored, its steps as a waterfall, each stage with its decision and
    step, the policy decisions."""
    console = Console.of(request)
    store, session = await reviewer(console, request, "show", {"record_id": record_id})
    record = await call(store.get, record_id)
    if record is None:
        raise Problem(404, "Not found", f"no audit record {record_id!r}", "record_not_found")
    record = await call(store.reveal, record, session.principal.key_id if session.principal else None,
                        session.principal.role if session.principal else None)
    return console.page(request, session, "record.html", record=record, waterfall=from_record(record))


@post("/audit/verify", name="console-audit-verify", status_code=200)
async def verify_page(request: Request) -> Response[str]:
    """Recompute the hash chain (all of it, or records received in [since, until)) and show the result."""
    console = Console.of(request)
    session = await console.session(request, _ROLES, _WHAT)
    form = await request.form()
    submitted = form.get(CSRF_FIELD)
    console.sessions.check_csrf(request, session, submitted if isinstance(submitted, str) else None)
    since_text, until_text = (str(form.get("since") or ""), str(form.get("until") or ""))
    since, until = parse_time("since", since_text), parse_time("until", until_text)
    store, _ = await reviewer(console, request, "verify", {"since": since_text, "until": until_text}, session)
    report = await call(store.verify, since, until)
    return console.page(request, session, "verify.html", report=report, since=since_text, until=until_text)


@get("/audit/export", name="console-audit-export", dependencies={"filters": audit_filters}, **_GUARDED)
async def export(request: Request, filters: NamedDependency[AuditFilters],
                 format: FromQuery[str | None] = None) -> Response[Any]:
    """The filtered records as a JSON Lines or CSV download, streamed."""
    console = Console.of(request)
    fmt = format or "jsonl"
    if fmt not in ("jsonl", "csv"):
        raise Problem(400, "Bad request", f"format must be jsonl or csv, not {fmt!r}", "invalid_query")
    store, _ = await reviewer(console, request, "export", {**echo_of(request.query_params), "format": fmt})
    lines = await call(store.export, filters, fmt)
    media = "application/x-ndjson" if fmt == "jsonl" else "text/csv"
    return Stream(async_lines(lines), media_type=media,
                  headers={**SECURITY_HEADERS, "Content-Disposition": f'attachment; filename="audit.{fmt}"'})


@get("/audit/records/{record_id:str}/spec", name="console-audit-record-spec", **_GUARDED)
async def record_spec_page(request: Request, record_id: FromPath[str]) -> Response[str]:
    """The pipeline file that served one record, as it was then."""
    console = Console.of(request)
    store, session = await reviewer(console, request, "show spec", {"record_id": record_id})
    record = await call(store.get, record_id)
    if record is None:
        raise Problem(404, "Not found", f"no audit record {record_id!r}", "record_not_found")
    version = await asyncio.to_thread(spec_of, store.engine, record)
    return console.page(request, session, "spec.html", record=record, version=version)


async def find_record(console: Console, request: Request, session: Session, ident: str) -> dict[str, Any] | None:
    """The audit record of a request, by record id, request id or trace id (reviewers only)."""
    store, _ = await reviewer(console, request, "show", {"trace": ident}, session)
    found = await call(store.get, ident)
    if found is None:
        record_id = await asyncio.to_thread(store.find_id, ident)
        found = await call(store.get, record_id) if record_id else None
    return found


async def async_lines(lines: Iterator[str]) -> AsyncIterator[bytes]:
    """A blocking line generator (the store's export), each line pulled off the event loop."""
    done = object()
    while (line := await asyncio.to_thread(next, lines, done)) is not done:
        yield line.encode() if isinstance(line, str) else line


@get("/audit/report", name="console-audit-report", **_GUARDED)
async def report_page(request: Request, since: FromQuery[str | None] = None, until: FromQuery[str | None] = None,
                      pipeline: FromQuery[str | None] = None, format: FromQuery[str | None] = None) -> Response[Any]:
    """The reviewers' report over a period (default: the last 90 days): requests, blocks, errors, cost, the
    chain's and the anchors' verification, who read the log. ``format=json`` downloads it."""
    console = Console.of(request)
    if format not in (None, "", "json"):
        raise Problem(400, "Bad request", f"format must be json, not {format!r}", "invalid_query")
    since_text = since if since is not None else "90d"
    filters = AuditFilters(since=parse_time("since", since_text), until=parse_time("until", until),
                           pipeline=pipeline or None)
    store, session = await reviewer(console, request, "report", {"since": since_text, "until": until,
                                                                 "pipeline": pipeline})
    report = await call(store.report, filters, console.anchors_dir())
    if format == "json":
        return Response(report, media_type="application/json", headers={
            **SECURITY_HEADERS, "Content-Disposition": 'attachment; filename="audit-report.json"'})
    query = urlencode({k: v for k, v in (("since", since_text), ("until", until), ("pipeline", pipeline)) if v})
    return console.page(request, session, "report.html", report=report, since=since_text, until=until or "",
                        pipeline=pipeline or "", query=query)


ROUTES = [audit_page, access_page, record_page, record_spec_page, verify_page, export, report_page]
