"""``inferline audit``: the reviewers' queries from the command line, and retention.

    inferline audit query [--pipeline P] [--since T] [--status S] ... [--limit N]
    inferline audit show RECORD_ID
    inferline audit summary [--group-by pipeline|model|key_id|day]
    inferline audit verify [--since T] [--until T] [--workers N]   exit 1 on any finding
    inferline audit export [--format jsonl|csv] [...]        to stdout
    inferline audit prune                                    past each pipeline's retention, not on hold
    inferline audit hold (--pipeline P | --record ID...) [--release]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import Any

from serving.audit_sink import open_store
from serving.wiring import Workspace, open_workspace
from store.audit import AuditFilters, AuditStore
from store.db import create_schema, make_engine


def add_audit_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``audit`` and its actions; each sets ``handler(args) -> exit code``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", metavar="FILE", help="server config (as for serve)")
    parser = subparsers.add_parser("audit", help="query, verify, export and prune the audit log",
                                   description="Read the tamper-evident audit log of the server config's database.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    query = actions.add_parser("query", parents=[common], help="list records matching filters (JSON lines)")
    _filter_options(query)
    query.add_argument("--sort", default="-received_at", help="received_at | cost_usd | duration_ms | seq, "
                                                              "'-' for descending (default -received_at)")
    query.add_argument("--limit", type=int, default=50)
    query.add_argument("--cursor", help="next_cursor of the previous page")
    query.set_defaults(handler=_query)

    show = actions.add_parser("show", parents=[common], help="one record with its stages")
    show.add_argument("record_id")
    show.set_defaults(handler=_show)

    summary = actions.add_parser("summary", parents=[common], help="counts, block rate, tokens and cost, grouped")
    summary.add_argument("--group-by", default="pipeline", choices=["pipeline", "model", "key_id", "day"])
    _time_options(summary)
    summary.set_defaults(handler=_summary)

    verify = actions.add_parser("verify", parents=[common], help="recompute the hash chain; exit 1 on any finding")
    _time_options(verify)
    verify.add_argument("--workers", type=_positive, metavar="N",
                        help="processes that recompute hashes in parallel (default: one per CPU, for "
                             "spans of 40,000+ records; 1: this process only)")
    verify.set_defaults(handler=_verify)

    export = actions.add_parser("export", parents=[common], help="export records to stdout")
    export.add_argument("--format", default="jsonl", choices=["jsonl", "csv"])
    _filter_options(export)
    export.set_defaults(handler=_export)

    prune = actions.add_parser("prune", parents=[common],
                               help="delete records past their pipeline's retention_days (not on hold)")
    prune.set_defaults(handler=_prune)

    hold = actions.add_parser("hold", parents=[common], help="put records on legal hold (or --release them)")
    target = hold.add_mutually_exclusive_group(required=True)
    target.add_argument("--pipeline")
    target.add_argument("--record", nargs="+", dest="records", metavar="ID")
    hold.add_argument("--release", action="store_true", help="take them off hold instead")
    hold.set_defaults(handler=_hold)
    return parser


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {value!r}")
    return number


def _time_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--since", type=datetime.fromisoformat, help="ISO time, e.g. 2026-11-01T00:00:00+00:00")
    parser.add_argument("--until", type=datetime.fromisoformat)


def _filter_options(parser: argparse.ArgumentParser) -> None:
    _time_options(parser)
    for name in ("pipeline", "spec-sha256", "key-id", "model", "policy-action", "policy-category", "status",
                 "finish-reason", "text"):
        parser.add_argument(f"--{name}")
    parser.add_argument("--min-cost-usd", type=float)


def _store(args: argparse.Namespace) -> AuditStore:
    workspace = open_workspace(args.config)
    engine = make_engine(workspace.database_url)
    create_schema(engine)
    return open_store(workspace, engine)


def _filters(args: argparse.Namespace) -> AuditFilters:
    names = ("since", "until", "pipeline", "spec_sha256", "key_id", "model", "policy_action", "policy_category",
             "status", "finish_reason", "min_cost_usd", "text")
    return AuditFilters(**{name: getattr(args, name, None) for name in names})


def _print_json(value: Any) -> None:
    print(json.dumps(value, default=str))


def _query(args: argparse.Namespace) -> int:
    try:
        page = _store(args).query(_filters(args), sort=args.sort, cursor=args.cursor, limit=args.limit)
    except ValueError as exc:
        print(f"inferline: {exc}", file=sys.stderr)
        return 1
    for item in page.records:
        _print_json(item)
    if page.next_cursor:
        print(f"more: --cursor {page.next_cursor}", file=sys.stderr)
    return 0


def _show(args: argparse.Namespace) -> int:
    found = _store(args).get(args.record_id)
    if found is None:
        print(f"inferline: no audit record {args.record_id!r}", file=sys.stderr)
        return 1
    print(json.dumps(found, indent=2, default=str))
    return 0


def _summary(args: argparse.Namespace) -> int:
    for group in _store(args).summary(AuditFilters(since=args.since, until=args.until), args.group_by):
        _print_json(group)
    return 0


def _verify(args: argparse.Namespace) -> int:
    report = _store(args).verify(args.since, args.until, workers=args.workers)
    for finding in report.findings:
        print(f"{finding.kind}: seq {finding.seq} record {finding.record_id}: {finding.detail}")
    verdict = "ok" if report.ok else f"FAILED ({len(report.findings)} finding(s))"
    print(f"{verdict}: {report.checked} record(s) checked, head seq {report.head_seq}")
    return 0 if report.ok else 1


def _export(args: argparse.Namespace) -> int:
    for line in _store(args).export(_filters(args), args.format):
        sys.stdout.write(line if line.endswith("\n") else line + "\n")
    return 0


def _prune(args: argparse.Namespace) -> int:
    report = _store(args).prune(retention_days(open_workspace(args.config)))
    print(f"pruned {report.deleted} record(s); marker {report.marker_id}")
    return 0


def _hold(args: argparse.Namespace) -> int:
    count = _store(args).set_hold(pipeline=args.pipeline, record_ids=args.records, on=not args.release)
    print(f"{'released' if args.release else 'held'} {count} record(s)")
    return 0


def retention_days(workspace: Workspace) -> dict[str, int]:
    """Each pipeline's retention, from its audit stage's ``retention_days``."""
    days = {}
    for loaded in workspace.load_all():
        for plan in loaded.plans:
            if plan.spec.type == "audit":
                days[loaded.spec.name] = plan.config.retention_days  # type: ignore[attr-defined]
    return days
