"""Replay: audited requests run again through a candidate version, old answer against new.

    results = await replay(workspace, candidate, records, engines=None, concurrency=4)
    totals = summarize_replay(results, skipped)

A record can be replayed when its audit stage kept its content in full (``content: full``): its input
is sent again as the one user message it was (the audit record keeps the last user message, not a
whole chat), through the candidate pipeline in-process, over the config's real models. Records kept
as a hash or redacted are skipped, and counted by why. The candidate's own audit stage runs, but its
records are not written: a replay is an experiment, not a request anyone made, and the log stays the
record of what was served.
"""

from __future__ import annotations

import asyncio
import html
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pipeline.context import RequestContext
from pipeline.events import Done, Error
from pipeline.loader import LoadedPipeline
from pipeline.protocols import EngineProvider
from serving.runtime.resources import Runtime, RuntimeOptions
from serving.runtime.workspace import Workspace
from stages.checks import normalize


def replayable(record: dict[str, Any]) -> str | None:
    """None when *record* can be replayed, else why not."""
    if record.get("kind", "record") != "record":
        return "not a request"
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
        "record_id": record.get("id"), "request_id": record.get("request_id"),
        "identical": old_output == new_output,
        "normalized_identical": normalize(old_output) == normalize(new_output),
        "old": {"version": record.get("pipeline_version"), "status": record.get("status"),
                "finish_reason": record.get("finish_reason"), "duration_ms": record.get("duration_ms"),
                "ttft_ms": record.get("ttft_ms"), "output_tokens": record.get("output_tokens"),
                "cost_usd": record.get("cost_usd"), "policy_action": record.get("policy_action"),
                "output": old_output},
        "new": {"version": summary.pipeline_version, "status": "ok" if isinstance(final, Done) else final.status,
                "finish_reason": summary.finish_reason, "duration_ms": round(summary.duration_s * 1e3, 3),
                "ttft_ms": None if summary.ttft_s is None else round(summary.ttft_s * 1e3, 3),
                "output_tokens": summary.usage.output_tokens, "cost_usd": summary.cost_usd,
                "policy_action": _policy_action(ctx), "output": new_output},
    }


def _policy_action(ctx: RequestContext) -> str | None:
    actions = [entry.get("action") for entry in ctx.facts.get("policy", [])]
    for action in ("block", "redact", "flag"):
        if action in actions:
            return action
    return None


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
