"""The reviewers' API: query, read, summarize, verify and export the audit log.

Only ``auditor`` and ``admin`` keys may call these routes, and every call is
itself written to the access log (who asked what, when), which ``/audit/access`` reads.
Records, summaries and exports take the same filters (serving/http/audit_params.py); a query
parameter a route does not take is a 400 that names it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from typing import Annotated, Any, Literal

from litestar import Request, get
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, QueryParameter
from litestar.response import Response, Stream

from pipeline.context import Principal
from serving.http.audit_params import access_filters, audit_filters, refuse_unknown_query, time_range
from serving.http.openapi import JsonLinesOrCsv, problems
from serving.http.problems import Problem
from serving.http.services import Services
from store.audit import MAX_LIMIT, SORT_FIELDS, AccessFilters, AuditFilters, AuditReader
from store.pipeline_versions import PipelineVersion, PipelineVersions

_ROLES = ("auditor",)
# Documented for clients, checked by the store (a value outside them is its 400, naming what is allowed).
_Sort = Annotated[str, QueryParameter(schema_extra={"enum": [f"{sign}{name}" for name in SORT_FIELDS
                                                            for sign in ("", "-")]})]
_Limit = Annotated[int, QueryParameter(schema_extra={"minimum": 1, "maximum": MAX_LIMIT})]
_Services = NamedDependency[Services]


async def _reviewer(request: Request, services: Services, action: str,
                    query: dict[str, Any]) -> tuple[AuditReader, Principal | None]:
    principal = await services.auth.authorize(request, _ROLES, "read the audit log")
    reader = services.audit.reader
    clean = {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in query.items() if v is not None}
    await asyncio.to_thread(reader.log_access, principal.key_id if principal else None,
                            principal.role if principal else None, action, clean)
    await services.audit_read_barrier()
    return reader, principal


async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except ValueError as exc:  # the store's word for a bad sort, cursor or filter
        raise Problem(400, "Bad request", str(exc), "invalid_query") from exc


_ROUTE = {"tags": ["audit"], "guards": [refuse_unknown_query]}


@get("/audit/records", summary="Query audit records (filters, sorting, cursor pagination)", **_ROUTE,
     dependencies={"filters": audit_filters}, responses=problems(400, 401, 403, 422, 503))
async def records(request: Request, services: _Services, filters: NamedDependency[AuditFilters],
                  sort: _Sort = "-received_at", cursor: FromQuery[str | None] = None,
                  limit: _Limit = 50) -> dict[str, Any]:
    store, _ = await _reviewer(request, services, "query",
                               {**filters.given(), "sort": sort, "cursor": cursor, "limit": limit})
    page = await _call(store.query, filters, sort=sort, cursor=cursor, limit=limit)
    return {"records": page.records, "next_cursor": page.next_cursor}


@get("/audit/records/{record_id:str}", summary="One audit record with its stages", **_ROUTE,
     responses=problems(400, 401, 403, 404, 503))
async def record(request: Request, services: _Services, record_id: FromPath[str]) -> dict[str, Any]:
    store, principal = await _reviewer(request, services, "show", {"record_id": record_id})
    found = await _call(store.get, record_id)
    if found is None:
        raise Problem(404, "Not found", f"no audit record {record_id!r}", "record_not_found")
    # content: encrypted comes back decrypted beside the ciphertext (or content_erased), the read logged.
    return await _call(store.reveal, found, principal.key_id if principal else None,
                       principal.role if principal else None)


@get("/audit/records/{record_id:str}/spec", summary="The pipeline file (YAML) that served one record", **_ROUTE,
     responses=problems(400, 401, 403, 404, 503))
async def record_spec(request: Request, services: _Services, record_id: FromPath[str]) -> dict[str, Any]:
    store, _ = await _reviewer(request, services, "show spec", {"record_id": record_id})
    found = await _call(store.get, record_id)
    if found is None:
        raise Problem(404, "Not found", f"no audit record {record_id!r}", "record_not_found")
    return version_json(await asyncio.to_thread(spec_of, store.engine, found))


def spec_of(engine: Any, record: dict[str, Any]) -> PipelineVersion:
    """The pipeline version that served *record* (by its spec hash); 404 if it was never recorded (a
    record older than pipeline versions, or written by a process that did not record them)."""
    version = PipelineVersions(engine).by_sha256(record["spec_sha256"], record["pipeline"])
    if version is None:
        raise Problem(404, "Not found", f"version {record['spec_sha256'][:12]} of pipeline {record['pipeline']!r} "
                      "is not in the database (only pipelines loaded by a server since versions are kept are)",
                      "version_not_found")
    return version


def version_json(version: PipelineVersion) -> dict[str, Any]:
    return {"pipeline": version.name, "version": version.label, "spec_sha256": version.spec_sha256,
            "source": version.source, "deployed_by": version.deployed_by,
            "deployed_at": version.deployed_at.isoformat(), "text": version.text}


@get("/audit/summary", summary="Counts, block rate, tokens and cost, grouped", **_ROUTE,
     dependencies={"filters": audit_filters}, responses=problems(400, 401, 403, 422, 503))
async def summary(request: Request, services: _Services, filters: NamedDependency[AuditFilters],
                  group_by: FromQuery[Literal["pipeline", "model", "key_id", "day"]] = "pipeline") -> dict[str, Any]:
    store, _ = await _reviewer(request, services, "summary", {"group_by": group_by, **filters.given()})
    return {"group_by": group_by, "groups": await _call(store.summary, filters, group_by)}


@get("/audit/verify", summary="Recompute the hash chain and report any tampering", **_ROUTE,
     dependencies={"filters": time_range}, responses=problems(400, 401, 403, 422, 503))
async def verify(request: Request, services: _Services, filters: NamedDependency[AuditFilters]) -> dict[str, Any]:
    store, _ = await _reviewer(request, services, "verify", filters.given())
    report = await _call(store.verify, filters.since, filters.until)
    tail = report.uncovered  # the newest records no signed checkpoint covers yet
    return {"ok": report.ok, "checked": report.checked, "head_seq": report.head_seq,
            "findings": [{"kind": f.kind, "seq": f.seq, "record_id": f.record_id, "detail": f.detail}
                         for f in report.findings],
            "uncovered": None if tail is None else {"first_seq": tail.first_seq, "last_seq": tail.last_seq,
                                                    "count": tail.count, "since": tail.since.isoformat()}}


@get("/audit/export", summary="Export records as JSON Lines or CSV, streamed", **_ROUTE,
     dependencies={"filters": audit_filters}, operation_class=JsonLinesOrCsv,
     responses=problems(400, 401, 403, 422, 503))
async def export(request: Request, services: _Services, filters: NamedDependency[AuditFilters],
                 format: FromQuery[Literal["jsonl", "csv"]] = "jsonl") -> Response[Any]:
    store, _ = await _reviewer(request, services, "export", {"format": format, **filters.given()})
    lines = await _call(store.export, filters, format)  # a filter it cannot apply is a 400 before the stream
    media = "application/x-ndjson" if format == "jsonl" else "text/csv"
    return Stream(_async_lines(lines), media_type=media,
                  headers={"Content-Disposition": f'attachment; filename="audit.{format}"'})


@get("/audit/access", summary="The reviewers' access log: who read the audit log, newest first", **_ROUTE,
     dependencies={"filters": access_filters}, responses=problems(400, 401, 403, 422, 503))
async def access(request: Request, services: _Services, filters: NamedDependency[AccessFilters],
                 cursor: FromQuery[str | None] = None, limit: _Limit = 50) -> dict[str, Any]:
    store, _ = await _reviewer(request, services, "access", {**filters.given(), "cursor": cursor, "limit": limit})
    page = await _call(store.access, filters, cursor=cursor, limit=limit)
    return {"entries": page.records, "next_cursor": page.next_cursor}


async def _async_lines(lines: Iterator[str]) -> AsyncIterator[bytes]:
    # The store's export is a blocking generator: pull each batch of lines off the event loop.
    sentinel = object()
    while (line := await asyncio.to_thread(next, lines, sentinel)) is not sentinel:
        yield line.encode() if isinstance(line, str) else line


ROUTES = [records, record, record_spec, summary, verify, export, access]
