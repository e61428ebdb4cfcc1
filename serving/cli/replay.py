"""``inferline replay NAME --candidate FILE``: what a new version would have answered to real requests.

    inferline replay support --candidate support-v4.yaml --since 24h --limit 200
    inferline replay support --candidate support-v4.yaml --format jsonl > replay.jsonl
    inferline replay support --candidate support-v4.yaml --html replay.html
    inferline replay draft_check --candidate draft_check-v2.yaml --full     # rerun every step
    inferline replay support --candidate support-v4.yaml --url http://10.0.0.5:8000 --key $ADMIN_KEY
    inferline replay support --candidate 4 --url http://10.0.0.5:8000        # a version kept there

Reads the audit records of pipeline NAME from the config's database (those whose content was kept in
full: ``content: full`` on the audit stage; the others are skipped and counted), runs each record's
request again (its last user message, the sampling its caller set, its tags and end user) through the
candidate in-process over the config's models, and reports per request and in total: identical
outputs, latency, tokens, cost and policy decisions, old against new, and what of each request the
record did not keep (serving/evals/replay.py). Exit 1 when any answer changed.

In-process, a replay goes by step: each step whose definition and inputs are the same as in the record reuses
its recorded output, and only the steps the candidate changed, and those after them that read something new,
run again; the report shows per step reused or rerun, old against new, and what reusing saved. ``--full``
reruns every step. A record that keeps hashes only (``content: hash``), or redacted or encrypted content, is
skipped, and says which steps the candidate changed.

With ``--url``, the records come from that server's audit API, the candidate file is kept there (not
served) and each input is sent to the server pinned to it, on the server's own models; ``--candidate``
may then also name a version the server keeps (its label or spec hash prefix). The pipeline API takes no
recorded outputs, so that replay reruns whole requests: step reuse runs in-process only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from pipeline.errors import SpecError
from serving.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Subcommands
from serving.evals.replay_report import (
    CONTENT_KEPT,
    NOT_A_REQUEST,
    changes_text,
    html_report,
    ms,
    saved_text,
    step_line,
)
from serving.runtime.database import open_database
from serving.runtime.workspace import open_workspace
from store.audit import MAX_LIMIT, AuditReader, parse_filters

EXIT_CHANGED = EXIT_FAILED  # an answer changed


def add_replay_parser(sub: Subcommands) -> None:
    parser = sub.add_parser(
        "replay", help="re-run audited requests through a candidate version; old answers against new",
        description="Re-run the audited requests of PIPELINE (content kept in full) through a candidate "
                    "pipeline file, in-process or on a running server (--url), each as its record keeps it (its "
                    "last user message, the sampling its caller set, its tags and end user), and compare: "
                    "identical outputs, latency, tokens, cost, policy decisions, and per request what the record "
                    "could not restore. In-process, steps whose definition and inputs are unchanged reuse their "
                    "recorded outputs (the report shows each step reused or rerun, and what that saved); --url "
                    "and --full rerun every step. Exit 1 when any answer changed.")
    parser.add_argument("pipeline", metavar="PIPELINE", help="the pipeline whose audited requests to replay")
    parser.add_argument("--candidate", required=True, metavar="FILE|VERSION",
                        help="the candidate pipeline file; with --url also a version the server keeps")
    parser.add_argument("--url", help="replay on this running server (its audit log, its models) instead of "
                                      "in-process; whole requests: step reuse runs in-process only")
    parser.add_argument("--full", action="store_true",
                        help="rerun every step, reusing no recorded output (in-process; --url always does)")
    parser.add_argument("--key", default=os.environ.get("INFERLINE_API_KEY"),
                        help="with --url: an API key with the auditor and caller roles, and admin to keep a "
                             "candidate file (default: $INFERLINE_API_KEY; none when the server's auth is off)")
    parser.add_argument("--since", help="records from (ISO 8601 or relative: 24h, 7d, yesterday)")
    parser.add_argument("--until", help="records before")
    parser.add_argument("--status", help="only records of this status (ok, failed, denied, ...)")
    parser.add_argument("--limit", type=int, default=100, help="at most this many records, newest first (100)")
    parser.add_argument("--concurrency", "-n", type=int, default=4, help="requests in flight at once (4)")
    parser.add_argument("--format", choices=("table", "jsonl"), default=None,
                        help="per-request output: a table (default on a terminal) or JSON lines")
    parser.add_argument("--html", type=Path, metavar="FILE", help="also write an HTML report")
    parser.add_argument("--config", "-c", metavar="FILE", help="server config (default: $INFERLINE_CONFIG, else "
                                                               "./inferline.yaml if present)")
    parser.set_defaults(handler=_replay)


def _replay(args: argparse.Namespace) -> int:
    # Here, not at the top: replaying runs pipelines (torch, transformers), which the other commands and
    # `inferline --help` need not import.
    from serving.evals.replay import ReplayError, replay, summarize_replay

    if args.limit < 1 or args.concurrency < 1:
        print("inferline replay: --limit and --concurrency must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        filters = parse_filters({"pipeline": args.pipeline, "since": args.since, "until": args.until,
                                 "status": args.status})
    except ValueError as exc:
        print(f"inferline replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.url:
        try:
            results, skipped = asyncio.run(_on_server(args, filters))
        except (ReplayError, httpx.HTTPError) as exc:
            print(f"inferline replay: {args.url}: {exc}", file=sys.stderr)
            return EXIT_CHANGED
    else:
        workspace = open_workspace(args.config)
        try:
            candidate = workspace.load_pipeline(Path(args.candidate))
        except SpecError as exc:
            print(exc, file=sys.stderr)
            return EXIT_CHANGED
        records, skipped = read_records(workspace.database_url, filters, args.limit, with_stages=True)
        results = asyncio.run(replay(workspace, candidate, records, concurrency=args.concurrency, full=args.full,
                                     skipped=skipped))
    totals = summarize_replay(results, skipped)
    show(results, skipped, totals, args.format or ("table" if sys.stdout.isatty() else "jsonl"))
    if args.html:
        args.html.write_text(html_report(args.pipeline, str(args.candidate), totals, results, skipped))
    return EXIT_OK if totals["identical"] == totals["replayed"] else EXIT_CHANGED


async def _on_server(args: argparse.Namespace,
                     filters: Any) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    from serving.evals.replay import ReplayServer

    async with ReplayServer(args.url, args.key) as server:
        candidate = Path(args.candidate)
        text = candidate.read_text() if candidate.is_file() else None
        version = await server.keep(args.pipeline, text) if text is not None else args.candidate
        records, skipped = await server.records(args.pipeline, filters, args.limit)
        return await server.replay(args.pipeline, version, records, candidate_text=text,
                                   concurrency=args.concurrency), skipped


def read_records(url: str, filters: Any, limit: int, *,
                 with_stages: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Up to *limit* matching records, newest first: those that can be replayed, and the others with why
    not (``{"record_id", "why"}``). *with_stages*: each with its ``stages`` (the steps a replay by step
    reuses), the requests skipped for their content too (with their ``content_mode``: they still tell which
    steps a candidate changed)."""
    from serving.evals.replay import sort_out

    with open_database(url) as engine:
        reader = AuditReader(engine)
        records: list[dict[str, Any]] = []
        skipped: list[dict[str, str]] = []
        cursor = None
        while len(records) + len(skipped) < limit:
            page = reader.query(filters, cursor=cursor, limit=min(MAX_LIMIT, limit))
            sort_out(page.records[:limit - len(records) - len(skipped)], records, skipped)
            cursor = page.next_cursor
            if cursor is None:
                break
        if with_stages:
            _add_stages(reader, records, skipped)
        return records, skipped


def _add_stages(reader: AuditReader, records: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> None:
    """Each record's ``stages``; each record skipped for how it keeps its content, its stages and that mode."""
    for record in records:
        record["stages"] = (reader.get(str(record["id"])) or {}).get("stages") or []
    for entry in skipped:
        if entry["why"].startswith(CONTENT_KEPT):
            found = reader.get(entry["record_id"]) or {}
            entry |= {"stages": found.get("stages") or [], "content_mode": found.get("content_mode")}


def show(results: list[dict[str, Any]], skipped: list[dict[str, Any]], totals: dict[str, Any], fmt: str) -> None:
    """Each comparison (a table line and a line per step, or a JSON line), each request skipped (table only, but
    for those that tell which steps changed), then the totals."""
    if fmt == "jsonl":
        for result in results:
            print(json.dumps(result, default=str))
        for skip in skipped:
            if skip.get("steps"):
                print(json.dumps({"record_id": skip["record_id"], "skipped": skip["why"], "steps": skip["steps"],
                                  "reuse": skip["reuse"]}, default=str))
    else:
        for r in results:
            old, new = r["old"], r["new"]
            mark = "same" if r["identical"] else "DIFF"
            missing = ", ".join(note["what"] for note in r["not_restored"])
            print(f"{mark}  {str(r['record_id'])[:12]:<12}  ms {ms(old['duration_ms'])} -> {ms(new['duration_ms'])}  "
                  f"tokens {old['output_tokens']} -> {new['output_tokens']}  "
                  f"policy {old['policy_action']} -> {new['policy_action']}"
                  + (f"  not restored: {missing}" if missing else ""))
            for step in r.get("steps", ()):
                print(f"      {step_line(step)}")
        for skip in skipped:
            if skip["why"] != NOT_A_REQUEST:
                print(f"skip  {skip['record_id'][:12]:<12}  {skip['why']}"
                      + (f"; {changes_text(skip['steps'])} ({skip['reuse']})" if skip.get("steps") else ""))
    err = sys.stderr
    print(f"replayed {totals['replayed']}: {totals['identical']} identical ({totals['normalized_identical']} after "
          f"normalizing), {totals['status_changed']} changed status, {totals['policy_changed']} changed policy "
          f"decision; p50 ms {ms(totals['duration_ms_p50']['old'])} -> {ms(totals['duration_ms_p50']['new'])}; "
          f"output tokens {totals['output_tokens']['old']} -> {totals['output_tokens']['new']}; cost USD "
          f"{totals['cost_usd']['old']} -> {totals['cost_usd']['new']}", file=err)
    if totals.get("steps"):
        print(saved_text(totals["steps"]), file=err)
    if totals["not_restored"]:
        missing = ", ".join(f"{what} {n}" for what, n in totals["not_restored_by_what"].items())
        print(f"not restored in {totals['not_restored']} request(s): {missing} (not in the audit record, or refused "
              "by the candidate; each comparison's not_restored says what and why)", file=err)
    if totals["skipped"]:
        reasons = ", ".join(f"{n} {why}" for why, n in totals["skipped_by_reason"].items())
        print(f"skipped {totals['skipped']} record(s) that cannot be replayed ({reasons}): only records whose "
              "audit stage keeps content in full (content: full) can be", file=err)
