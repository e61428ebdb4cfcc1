"""Replay: audited requests run again through a candidate version, old answer against new.

    results = await replay(workspace, candidate, records, engines=None, concurrency=4, full=False, skipped=skipped)
    totals = summarize_replay(results, skipped)                       # skipped: [{"record_id", "why"}]

    server = ReplayServer("http://10.0.0.5:8000", key)                 # or against a running server
    records, skipped = await server.records("support", filters, 200)   # its audit log (auditor)
    sha = await server.keep("support", yaml_text)                        # the candidate, kept, not served (admin)
    results = await server.replay("support", sha, records, candidate_text=yaml_text, concurrency=4)

A record can be replayed when its audit stage kept its content in full (``content: full``): its request
is rebuilt from the record (serving/evals/replay_request.py: its last user message, the sampling its
caller set, its tags and end user) and run through the candidate pipeline in-process, over the config's
real models; what the record does not keep is named per record (``not_restored``). Records kept as a
hash or redacted are skipped, each with why. The candidate's own audit stage runs, but its
records are not written: a replay is an experiment, not a request anyone made, and the log stays the
record of what was served.

In-process, a replay goes by step (serving/evals/replay_steps.py): where a record keeps its steps (``stages``
with their ``step``, as ``AuditReader.get`` gives them), each step whose definition and inputs are the same
in the candidate reuses its recorded output, and only the steps that changed, and those after them that read
something new, run again; each comparison says per step how it ran, old against new. ``full=True`` reruns
every step. A record skipped for keeping hashes only (or redacted or encrypted content) still tells which
steps the candidate changed, when its skipped entry carries its ``stages``.

Against a server (:class:`ReplayServer`), each request goes to ``POST /pipelines/NAME`` pinned to the
candidate (``X-Pipeline-Version``), on the server's models, tagged ``replay_of: <record id>``. Those
are requests the server really served, so they are audited there like any other; their records give
the new side's policy decision.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from pipeline.context import ChatMessage, RequestContext
from pipeline.events import Done, Error
from pipeline.loader import LoadedPipeline
from pipeline.protocols import EngineProvider
from pipeline.runner import Pipeline
from serving.evals.replay_report import CONTENT_KEPT, NOT_A_REQUEST
from serving.evals.replay_request import ReplayRequest, generate_config, rebuild
from serving.evals.replay_steps import NOT_REUSED, compare_steps, reusable, reuse_summary, step_changes
from serving.runtime.resources import Runtime, RuntimeOptions
from serving.runtime.workspace import Workspace
from stages.audit import output_content, strongest_action
from stages.checks import normalize
from stages.generate import GenerateConfig
from store.audit import MAX_LIMIT, AuditFilters
from store.pipeline_versions import PipelineVersions


def replayable(record: dict[str, Any]) -> str | None:
    """None when *record* can be replayed, else why not."""
    if record.get("kind", "record") != "record" or any(
            entry.get("where") == "deploy" for entry in record.get("policy") or []):
        return NOT_A_REQUEST  # a checkpoint, or a deploy action (serving/http/deploy_routes.py)
    mode = record.get("content_mode")
    if mode != "full":
        return f"{CONTENT_KEPT} {mode or 'nothing'}"
    if not record.get("input_content"):
        return "no input kept"
    return None


def sort_out(page: Sequence[dict[str, Any]], records: list[dict[str, Any]], skipped: list[dict[str, str]]) -> None:
    """*page*'s records into those that can be replayed (*records*) and the others, ``{"record_id", "why"}``
    (*skipped*)."""
    for record in page:
        why = replayable(record)
        if why is None:
            records.append(record)
        else:
            skipped.append({"record_id": str(record.get("id")), "why": why})


async def replay(workspace: Workspace, candidate: LoadedPipeline, records: Sequence[dict[str, Any]], *,
                 engines: EngineProvider | None = None, concurrency: int = 4, full: bool = False,
                 skipped: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Each replayable record run through *candidate*, reusing the outputs of the steps it did not change
    (*full*: rerunning every step); one comparison per record, in order. Each entry of *skipped* that carries
    its record's ``stages`` gets, in their place, which steps the candidate changed (``steps``) and why none
    was reused (``reuse``)."""
    gate = asyncio.Semaphore(max(1, concurrency))
    async with Runtime(workspace, [candidate], RuntimeOptions(engines=engines)) as runtime:
        runtime.resources.audit = _NotWritten()
        pipeline = runtime.pipelines[candidate.spec.name]
        for entry in skipped:
            _describe_skipped(pipeline, entry)
        served = {} if runtime.db is None else await asyncio.to_thread(_served_configs, PipelineVersions(runtime.db),
                                                                       records)
        ours = generate_config(candidate.text)

        async def one(record: dict[str, Any]) -> dict[str, Any]:
            request = rebuild(record, served.get(record.get("spec_sha256") or ""), ours)
            async with gate:
                messages = [ChatMessage(m["role"], m["content"]) for m in request.messages] or \
                    [ChatMessage("user", request.text)]
                ctx = RequestContext(candidate.spec.name, messages, tags=request.tags, params=request.params,
                                     reuse={} if full else reusable(record))
                final = await runtime.runner.run(pipeline, ctx)
            return compare(record, final, ctx, request, full=full)

        return list(await asyncio.gather(*(one(record) for record in records)))


def _served_configs(versions: PipelineVersions, records: Sequence[dict[str, Any]]) -> dict[str, GenerateConfig]:
    """The generate stage of each version that served one of *records*, by spec hash (those kept)."""
    found: dict[str, GenerateConfig] = {}
    for sha, name in {(r.get("spec_sha256") or "", r.get("pipeline")) for r in records}:
        version = versions.by_sha256(sha, name) if sha else None
        config = generate_config(version.text) if version is not None else None
        if config is not None:
            found[sha] = config
    return found


def _describe_skipped(pipeline: Pipeline, entry: dict[str, Any]) -> None:
    """*entry* (a record skipped, with its ``stages``): which steps *pipeline* changed, and why nothing of the
    record could be reused."""
    stages = entry.pop("stages", None)
    mode = entry.pop("content_mode", None)
    changes = step_changes(pipeline, {"stages": stages or ()})
    if changes is not None:
        entry["steps"] = changes
        entry["reuse"] = NOT_REUSED.get(str(mode), f"content kept as {mode}: nothing to reuse")


class _NotWritten:
    """The audit sink of a replay: the candidate's records are built (the stage runs as served), not kept."""

    async def write(self, record: dict[str, Any]) -> None:
        return None


def compare(record: dict[str, Any], final: Done | Error, ctx: RequestContext,
            request: ReplayRequest, *, full: bool = False) -> dict[str, Any]:
    """The old answer (the audit record) against the new one (the candidate's), each as the record keeps an
    answer (with ``n`` above 1, every answer's text as a JSON list); with the record's steps, each step old
    against new (``steps``) and what reusing them saved (``reuse``)."""
    summary, new_output = final.summary, output_content(ctx)
    steps = compare_steps(record, ctx.stages) if record.get("stages") else None
    by_step = {} if steps is None else {"steps": steps, "reuse": reuse_summary(steps, full=full)}
    return {
        **_sides(record, request, new_output),
        "new": {"version": summary.pipeline_version, "status": "ok" if isinstance(final, Done) else final.status,
                "finish_reason": summary.finish_reason, "duration_ms": round(summary.duration_s * 1e3, 3),
                "ttft_ms": None if summary.ttft_s is None else round(summary.ttft_s * 1e3, 3),
                "output_tokens": summary.usage.output_tokens, "cost_usd": summary.cost_usd,
                "policy_action": strongest_action(list(ctx.facts.get("policy", []))), "output": new_output,
                **({"error": f"{final.kind}: {final.message}"} if isinstance(final, Error) else {})},
        **by_step,
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

    async def records(self, name: str, filters: AuditFilters,
                      limit: int) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
        """Up to *limit* of pipeline *name*'s records matching *filters*, newest first: those that can be
        replayed, and the others with why not (:func:`sort_out`)."""
        params: dict[str, Any] = {**filters.given(), "pipeline": name}
        records: list[dict[str, Any]] = []
        skipped: list[dict[str, str]] = []
        cursor: str | None = None
        while len(records) + len(skipped) < limit:
            page = await self._json("GET", "/audit/records", params={
                **params, "limit": min(MAX_LIMIT, limit), **({"cursor": cursor} if cursor else {})})
            sort_out(page["records"][:limit - len(records) - len(skipped)], records, skipped)
            cursor = page.get("next_cursor")
            if cursor is None:
                break
        return records, skipped

    async def keep(self, name: str, text: str) -> str:
        """Keep *text* as a version of *name* on the server, serving nothing new; its spec hash."""
        return (await self._json("POST", f"/pipelines/{name}/versions", json={"yaml": text, "activate": False})
                )["spec_sha256"]

    async def replay(self, name: str, version: str, records: Sequence[dict[str, Any]], *,
                     candidate_text: str | None = None, concurrency: int = 4) -> list[dict[str, Any]]:
        """Each record's request sent to *name* pinned to *version* (whose YAML is *candidate_text*, when
        known here); one comparison per record, in order."""
        gate = asyncio.Semaphore(max(1, concurrency))
        started = datetime.now(UTC) - timedelta(minutes=5)  # the server's clock may be a little behind
        served = await self._served_configs(records)
        ours = generate_config(candidate_text) if candidate_text is not None else None

        async def one(record: dict[str, Any]) -> tuple[dict[str, Any], ReplayRequest, httpx.Response]:
            request = rebuild(record, served.get(record.get("spec_sha256") or ""), ours, can_send_n=False)
            body = request.body() | {"tags": {**request.tags, "replay_of": str(record.get("id"))}}
            async with gate:
                return record, request, await self.client.post(
                    f"/pipelines/{name}", headers={"X-Pipeline-Version": version}, json=body)

        answers = await asyncio.gather(*(one(record) for record in records))
        refused = [response for _, _, response in answers if response.status_code in (401, 404)]
        if refused:  # the pin or the key is wrong: no comparison to make
            response = refused[0]
            raise ReplayError(f"POST /pipelines/{name} ({version}): {response.status_code} {_detail(response)}")
        audited = await self._audited(name, started, {_request_id(response) for _, _, response in answers})
        return [compare_answer(record, request, response, audited.get(_request_id(response)))
                for record, request, response in answers]

    async def _served_configs(self, records: Sequence[dict[str, Any]]) -> dict[str, GenerateConfig]:
        """The generate stage of each version that served one of *records*, by spec hash: the server's
        ``GET /audit/records/ID/spec``, once per version (a version it does not keep is left out)."""
        found: dict[str, GenerateConfig] = {}
        asked: set[str] = set()
        for record in records:
            sha = record.get("spec_sha256") or ""
            if not sha or sha in asked:
                continue
            asked.add(sha)
            response = await self.client.get(f"/audit/records/{record.get('id')}/spec")
            if response.status_code == 404:
                continue
            if response.status_code >= 400:
                raise ReplayError(f"GET /audit/records/{record.get('id')}/spec: {response.status_code} "
                                  f"{_detail(response)}")
            config = generate_config(str(response.json().get("text", "")))
            if config is not None:
                found[sha] = config
        return found

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


def compare_answer(record: dict[str, Any], request: ReplayRequest, response: httpx.Response,
                   audited: dict[str, Any] | None) -> dict[str, Any]:
    """The old answer (the audit record) against the server's new one (its JSON answer, and its audit
    record when there is one: the policy decision and the status as the server recorded them)."""
    body: dict[str, Any] = response.json() if response.headers.get("content-type", "").endswith("json") else {}
    ok = response.status_code == 200
    status = audited["status"] if audited else ("ok" if ok else "denied" if response.status_code in (403, 429)
                                                else "failed")
    choices = body.get("choices")
    new_output = "" if not ok else json.dumps([c.get("output", "") for c in choices], ensure_ascii=False) \
        if isinstance(choices, list) else body.get("output", "")
    return {
        **_sides(record, request, new_output),
        "new": {"version": response.headers.get("x-pipeline-version"), "status": status,
                "finish_reason": body.get("finish_reason"), "duration_ms": body.get("duration_ms"),
                "ttft_ms": body.get("ttft_ms"), "output_tokens": (body.get("usage") or {}).get("output_tokens", 0),
                "cost_usd": body.get("cost_usd", 0.0),
                "policy_action": audited.get("policy_action") if audited else None, "output": new_output,
                **({} if ok else {"error": f"{response.status_code} {_detail(response)}"})},
    }


def _old_output(record: dict[str, Any], request: ReplayRequest) -> str:
    """The recorded answer; its first only when the record's ``n`` answers were asked for one (a route
    without ``n``)."""
    output = record.get("output_content") or ""
    if any(note["what"] == "n" for note in request.not_restored):
        try:
            answers = json.loads(output)
        except ValueError:
            return output
        return str(answers[0]) if isinstance(answers, list) and answers else output
    return output


def _sides(record: dict[str, Any], request: ReplayRequest, new_output: str) -> dict[str, Any]:
    old_output = _old_output(record, request)
    return {
        "record_id": record.get("id"), "request_id": record.get("request_id"),
        "sent": {"params": request.params, "tags": sorted(request.tags)},
        "not_restored": list(request.not_restored),
        "identical": old_output == new_output,
        "normalized_identical": normalize(old_output) == normalize(new_output),
        "old": {"version": record.get("pipeline_version"), "status": record.get("status"),
                "finish_reason": record.get("finish_reason"), "duration_ms": _ms(record.get("duration_ms")),
                "ttft_ms": _ms(record.get("ttft_ms")), "output_tokens": record.get("output_tokens"),
                "cost_usd": record.get("cost_usd"), "policy_action": record.get("policy_action"),
                "output": old_output},
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def summarize_replay(results: Sequence[dict[str, Any]], skipped: Sequence[dict[str, str]]) -> dict[str, Any]:
    """Totals: how many answers stayed the same, and old against new latency, tokens, cost and policy; the
    records skipped, by why; for a replay by step, ``steps``: how many steps were reused, rerun and skipped, what
    reusing saved, and how many skipped records told which steps changed."""
    def median(side: str, key: str) -> float | None:
        values = [r[side][key] for r in results if r[side][key] is not None]
        return round(statistics.median(values), 3) if values else None

    def total(side: str, key: str) -> float:
        return round(sum(r[side][key] or 0 for r in results), 6)

    missing = Counter(note["what"] for r in results for note in r["not_restored"])
    reasons = Counter(s["why"] for s in skipped)
    by_step = [r["reuse"] for r in results if "reuse" in r]
    return {**({"steps": _step_totals(by_step, skipped)} if by_step or any("steps" in s for s in skipped) else {}),
        "replayed": len(results), "identical": sum(r["identical"] for r in results),
        "normalized_identical": sum(r["normalized_identical"] for r in results),
        "status_changed": sum(r["old"]["status"] != r["new"]["status"] for r in results),
        "policy_changed": sum(r["old"]["policy_action"] != r["new"]["policy_action"] for r in results),
        "skipped": len(skipped), "skipped_by_reason": dict(reasons),
        "not_restored": sum(bool(r["not_restored"]) for r in results), "not_restored_by_what": dict(missing),
        "duration_ms_p50": {"old": median("old", "duration_ms"), "new": median("new", "duration_ms")},
        "output_tokens": {"old": total("old", "output_tokens"), "new": total("new", "output_tokens")},
        "cost_usd": {"old": total("old", "cost_usd"), "new": total("new", "cost_usd")},
    }


def _step_totals(reuses: Sequence[dict[str, Any]], skipped: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Steps reused, rerun and skipped over every request replayed by step, and what reusing saved."""
    saved = {name: round(sum(r["saved"][name] for r in reuses), 9 if name == "cost_usd" else 3)
             for name in ("input_tokens", "output_tokens", "cost_usd", "duration_ms")}
    return {"mode": reuses[0]["mode"] if reuses else "step",
            **{run: sum(r[run] for r in reuses) for run in ("reused", "rerun", "skipped")},
            "saved": saved, "changes_only": sum("steps" in s for s in skipped)}
