"""Replay: audited requests run again through a candidate version, old answer against new.

    results = await replay(workspace, candidate, records, engines=None, concurrency=4)
    totals = summarize_replay(results, skipped)

    server = ReplayServer("http://10.0.0.5:8000", key)                 # or against a running server
    records, skipped = await server.records("support", filters, 200)   # its audit log (auditor)
    sha = await server.keep("support", yaml_text)                        # the candidate, kept, not served (admin)
    results = await server.replay("support", sha, records, concurrency=4)

A record can be replayed when its audit stage kept its content in full (``content: full``): its input
is sent again as the one user message it was (the audit record keeps the last user message, not a
whole chat), through the candidate pipeline in-process, over the config's real models. Records kept
as a hash or redacted are skipped, and counted by why. The candidate's own audit stage runs, but its
records are not written: a replay is an experiment, not a request anyone made, and the log stays the
record of what was served.

Against a server (:class:`ReplayServer`), each input goes to ``POST /pipelines/NAME`` pinned to the
candidate (``X-Pipeline-Version``), on the server's models, tagged ``replay_of: <record id>``. Those
are requests the server really served, so they are audited there like any other; their records give
the new side's policy decision.
"""

from __future__ import annotations

import asyncio
import html
import statistics
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from pipeline.context import RequestContext
from pipeline.events import Done, Error
from pipeline.loader import LoadedPipeline
from pipeline.protocols import EngineProvider
from serving.runtime.resources import Runtime, RuntimeOptions
from serving.runtime.workspace import Workspace
from stages.audit import strongest_action
from stages.checks import normalize
from store.audit_filters import AuditFilters
from store.audit_query import MAX_LIMIT


def replayable(record: dict[str, Any]) -> str | None:
    """None when *record* can be replayed, else why not."""
    if record.get("kind", "record") != "record" or any(
            entry.get("where") == "deploy" for entry in record.get("policy") or []):
        return "not a request"  # a checkpoint, or a deploy action (serving/http/deploy_routes.py)
    mode = record.get("content_mode")
    if mode != "full":
        return f"content kept as {mode or 'nothing'}"
    if not record.get("input_content"):
        return "no input kept"
    return None


async def replay(workspace: Workspace, candidate: LoadedPipeline, records: Sequence[dict[str, Any]], *,
                 engines: EngineProvider | None = None, concurrency: int = 4) -> list[dict[str, Any]]:
    """Each replayable record run through *candidate*; one comparison per record, in order."""
    gate = asyncio.Semaphore(max(1, concurrency))
    async with Runtime(workspace, [candidate], RuntimeOptions(engines=engines)) as runtime:
        runtime.resources.audit = _NotWritten()
        pipeline = runtime.pipelines[candidate.spec.name]

        async def one(record: dict[str, Any]) -> dict[str, Any]:
            async with gate:
                ctx = RequestContext.from_text(candidate.spec.name, record["input_content"])
                final = await runtime.runner.run(pipeline, ctx)
            return compare(record, final, ctx)

        return list(await asyncio.gather(*(one(record) for record in records)))


class _NotWritten:
    """The audit sink of a replay: the candidate's records are built (the stage runs as served), not kept."""

    async def write(self, record: dict[str, Any]) -> None:
        return None


def compare(record: dict[str, Any], final: Done | Error, ctx: RequestContext) -> dict[str, Any]:
    """The old answer (the audit record) against the new one (the candidate's)."""
    summary = final.summary
    old_output, new_output = record.get("output_content") or "", summary.output_text
    return {
        **_sides(record, old_output, new_output),
        "new": {"version": summary.pipeline_version, "status": "ok" if isinstance(final, Done) else final.status,
                "finish_reason": summary.finish_reason, "duration_ms": round(summary.duration_s * 1e3, 3),
                "ttft_ms": None if summary.ttft_s is None else round(summary.ttft_s * 1e3, 3),
                "output_tokens": summary.usage.output_tokens, "cost_usd": summary.cost_usd,
                "policy_action": strongest_action(list(ctx.facts.get("policy", []))), "output": new_output},
    }


class ReplayServer:
    """Replay through a running server: its audit log, a candidate kept there, requests pinned to it. The
    key needs the roles of each step (``auditor`` to read records, ``admin`` to keep a file, the
    pipeline's roles to call it): an admin key has all."""

    def __init__(self, url: str, key: str | None, *, timeout_s: float = 300.0):
        self.client = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s, trust_env=False,
                                        headers={"Authorization": f"Bearer {key}"} if key else {})

    async def __aenter__(self) -> ReplayServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = await self.client.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise ReplayError(f"{method} {path}: {response.status_code} {_detail(response)}")
        return response.json()

    async def records(self, name: str, filters: AuditFilters, limit: int) -> tuple[list[dict[str, Any]], Counter[str]]:
        """Up to *limit* of pipeline *name*'s records matching *filters*, newest first: those that can be
        replayed, and the others counted by why not."""
        params: dict[str, Any] = {**filters.given(), "pipeline": name}
        records: list[dict[str, Any]] = []
        skipped: Counter[str] = Counter()
        cursor: str | None = None
        while len(records) + sum(skipped.values()) < limit:
            page = await self._json("GET", "/audit/records", params={
                **params, "limit": min(MAX_LIMIT, limit), **({"cursor": cursor} if cursor else {})})
            for record in page["records"][:limit - len(records) - sum(skipped.values())]:
                why = replayable(record)
                if why is None:
                    records.append(record)
                else:
                    skipped[why] += 1
            cursor = page.get("next_cursor")
            if cursor is None:
                break
        return records, skipped

    async def keep(self, name: str, text: str) -> str:
        """Keep *text* as a version of *name* on the server, serving nothing new; its spec hash."""
        return (await self._json("POST", f"/pipelines/{name}/versions", json={"yaml": text, "activate": False})
                )["spec_sha256"]

    async def replay(self, name: str, version: str, records: Sequence[dict[str, Any]], *,
                     concurrency: int = 4) -> list[dict[str, Any]]:
        """Each record's input sent to *name* pinned to *version*; one comparison per record, in order."""
        gate = asyncio.Semaphore(max(1, concurrency))
        started = datetime.now(UTC) - timedelta(minutes=5)  # the server's clock may be a little behind

        async def one(record: dict[str, Any]) -> tuple[dict[str, Any], httpx.Response]:
            async with gate:
                return record, await self.client.post(
                    f"/pipelines/{name}", headers={"X-Pipeline-Version": version},
                    json={"input": record["input_content"], "tags": {"replay_of": str(record.get("id"))}})

        answers = await asyncio.gather(*(one(record) for record in records))
        refused = [response for _, response in answers if response.status_code in (401, 404)]
        if refused:  # the pin or the key is wrong: no comparison to make
            response = refused[0]
            raise ReplayError(f"POST /pipelines/{name} ({version}): {response.status_code} {_detail(response)}")
        audited = await self._audited(name, started, {_request_id(response) for _, response in answers})
        return [compare_answer(record, response, audited.get(_request_id(response)))
                for record, response in answers]

    async def _audited(self, name: str, since: datetime, request_ids: set[str]) -> dict[str, dict[str, Any]]:
        """The server's audit records of the replayed requests, by request id (none when the candidate
        has no audit stage)."""
        found: dict[str, dict[str, Any]] = {}
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"pipeline": name, "since": since.isoformat(), "limit": MAX_LIMIT}
            if cursor:
                params["cursor"] = cursor
            page = await self._json("GET", "/audit/records", params=params)
            for record in page["records"]:
                if record.get("request_id") in request_ids:
                    found[record["request_id"]] = record
            cursor = page.get("next_cursor")
            if cursor is None or len(found) == len(request_ids):
                return found


class ReplayError(Exception):
    """The server refused a step of the replay (a wrong URL, key, role or candidate)."""


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    return str(body.get("detail") or body.get("title") or body)[:300] if isinstance(body, dict) else str(body)[:300]


def _request_id(response: httpx.Response) -> str:
    return response.headers.get("x-request-id", "")


def compare_answer(record: dict[str, Any], response: httpx.Response, audited: dict[str, Any] | None) -> dict[str, Any]:
    """The old answer (the audit record) against the server's new one (its JSON answer, and its audit
    record when there is one: the policy decision and the status as the server recorded them)."""
    body: dict[str, Any] = response.json() if response.headers.get("content-type", "").endswith("json") else {}
    ok = response.status_code == 200
    status = audited["status"] if audited else ("ok" if ok else "denied" if response.status_code in (403, 429)
                                                else "failed")
    old_output, new_output = record.get("output_content") or "", body.get("output", "") if ok else ""
    return {
        **_sides(record, old_output, new_output),
        "new": {"version": response.headers.get("x-pipeline-version"), "status": status,
                "finish_reason": body.get("finish_reason"), "duration_ms": body.get("duration_ms"),
                "ttft_ms": body.get("ttft_ms"), "output_tokens": (body.get("usage") or {}).get("output_tokens", 0),
                "cost_usd": body.get("cost_usd", 0.0),
                "policy_action": audited.get("policy_action") if audited else None, "output": new_output},
    }


def _sides(record: dict[str, Any], old_output: str, new_output: str) -> dict[str, Any]:
    return {
        "record_id": record.get("id"), "request_id": record.get("request_id"),
        "identical": old_output == new_output,
        "normalized_identical": normalize(old_output) == normalize(new_output),
        "old": {"version": record.get("pipeline_version"), "status": record.get("status"),
                "finish_reason": record.get("finish_reason"), "duration_ms": record.get("duration_ms"),
                "ttft_ms": record.get("ttft_ms"), "output_tokens": record.get("output_tokens"),
                "cost_usd": record.get("cost_usd"), "policy_action": record.get("policy_action"),
                "output": old_output},
    }


def summarize_replay(results: Sequence[dict[str, Any]], skipped: Counter[str]) -> dict[str, Any]:
    """Totals: how many answers stayed the same, and old against new latency, tokens, cost and policy."""
    def median(side: str, key: str) -> float | None:
        values = [r[side][key] for r in results if r[side][key] is not None]
        return round(statistics.median(values), 3) if values else None

    def total(side: str, key: str) -> float:
        return round(sum(r[side][key] or 0 for r in results), 6)

    return {
        "replayed": len(results), "identical": sum(r["identical"] for r in results),
        "normalized_identical": sum(r["normalized_identical"] for r in results),
        "status_changed": sum(r["old"]["status"] != r["new"]["status"] for r in results),
        "policy_changed": sum(r["old"]["policy_action"] != r["new"]["policy_action"] for r in results),
        "skipped": sum(skipped.values()), "skipped_by_reason": dict(skipped),
        "duration_ms_p50": {"old": median("old", "duration_ms"), "new": median("new", "duration_ms")},
        "output_tokens": {"old": total("old", "output_tokens"), "new": total("new", "output_tokens")},
        "cost_usd": {"old": total("old", "cost_usd"), "new": total("new", "cost_usd")},
    }


def html_report(name: str, candidate: str, totals: dict[str, Any], results: Sequence[dict[str, Any]]) -> str:
    """A self-contained HTML page (no outside assets): the totals, then each request old against new."""
    e = html.escape
    rows = "\n".join(
        f"<tr class=\"{'same' if r['identical'] else 'diff'}\"><td><code>{e(str(r['record_id']))}</code></td>"
        f"<td>{'yes' if r['identical'] else 'no'}</td><td>{e(r['old']['output'])}</td><td>{e(r['new']['output'])}</td>"
        f"<td>{r['old']['duration_ms']} / {r['new']['duration_ms']}</td>"
        f"<td>{r['old']['output_tokens']} / {r['new']['output_tokens']}</td>"
        f"<td>{e(str(r['old']['policy_action']))} / {e(str(r['new']['policy_action']))}</td></tr>"
        for r in results)
    facts = "".join(f"<dt>{e(k)}</dt><dd>{e(str(v))}</dd>" for k, v in totals.items())
    return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Replay of {e(name)}</title>"
            "<style>body{font:14px system-ui,sans-serif;margin:2rem}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:.3rem;vertical-align:top}.diff{background:#fff3f0}"
            "dt{font-weight:600}</style></head><body>"
            f"<h1>Replay of {e(name)} through {e(candidate)}</h1><dl>{facts}</dl>"
            "<table><thead><tr><th>record</th><th>identical</th><th>old output</th><th>new output</th>"
            "<th>ms old / new</th><th>tokens old / new</th><th>policy old / new</th></tr></thead>"
            f"<tbody>{rows}</tbody></table></body></html>\n")
