"""``inferline audit``: the reviewers' queries from the command line, and retention.

    inferline audit query [--since T] [--until T] [--pipeline P] [--key-id K] ... [--format table|jsonl|csv]
    inferline audit show RECORD_ID
    inferline audit summary [--group-by pipeline|model|key_id|day] [filters] [--format table|jsonl|csv]
    inferline audit verify [--since T] [--until T] [--workers N]   exit 1 on any finding
    inferline audit verify --public-key old.pub --public-key new.pub --anchors /mnt/digests
    inferline audit keygen --out audit-signing.pem                  an Ed25519 key pair (and .pub)
    inferline audit erase --subject tenant:acme                     crypto-shred a subject's encrypted content
    inferline audit report --since 90d [--pipeline P] [--format html|json] [--anchors DIR] > report.html
    inferline audit export [--format jsonl|csv] [filters]          to stdout
    inferline audit access [--since T] [--until T] [--key-id K] [--action A] [--format table|jsonl|csv]
    inferline audit prune                                           past each pipeline's retention, not on hold
    inferline audit hold (--pipeline P | --record ID...) [--release]

The filters are the API's (store/audit/filters.py), so one filter selects the same records on both.
A time T is ISO 8601 (without an offset: UTC) or relative: 30m, 24h, 7d, 2w, today, yesterday.
The database is ``--database URL``, else ``$INFERLINE_DATABASE``, else the server config's, as for
``inferline keys``. Listings print a table on a terminal and JSON lines otherwise (``--format``).
``verify`` and ``report`` check with the config's keys and its digests (``audit.anchors.dir``), or with
the public key and the digest folder a server made for itself beside a SQLite database
(serving/backends/audit_keys.py); ``--public-key`` and ``--anchors`` add or choose others.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from serving.backends.audit_keys import anchor_folder, checkpoint_signer, exposure_window_s, local_key, public_keys
from serving.backends.audit_sink import content_vault
from serving.cli.common import Subcommands
from serving.cli.keys import ENV_DATABASE, database_url
from serving.runtime.database import open_engine
from serving.runtime.workspace import Workspace, open_workspace
from store.audit import (
    ACCESS_FIELDS,
    FILTER_FIELDS,
    RANGE_FIELDS,
    TIME_HELP,
    AuditFilters,
    AuditMaintenance,
    AuditReader,
    Ed25519Signer,
    Tail,
    Verifier,
    age_text,
    generate_pem,
    parse_access_filters,
    parse_cost,
    parse_filters,
    parse_time,
    verify_anchors,
)
from store.pipeline_versions import PipelineVersions

FORMATS = ("table", "jsonl", "csv")
NO_MATCH = "no records match"


def add_audit_parser(subparsers: Subcommands) -> None:
    """Add ``audit`` and its actions; each sets ``handler(args) -> exit code``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", metavar="FILE", help="server config (as for serve)")
    common.add_argument("--database", metavar="URL",
                        help="database URL, e.g. sqlite:///inferline.db or postgresql://user@host/db "
                             f"(default: ${ENV_DATABASE}, else 'database:' of the server config)")
    parser = subparsers.add_parser("audit", help="query, verify, export and prune the audit log",
                                   description="Read the tamper-evident audit log of the server config's database. "
                                               f"Times: {TIME_HELP}.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    query = actions.add_parser("query", parents=[common], help="list records matching filters")
    _filter_options(query, FILTER_FIELDS)
    query.add_argument("--sort", default="-received_at", help="received_at | cost_usd | duration_ms | seq, "
                                                              "'-' for descending (default -received_at)")
    query.add_argument("--limit", type=int, default=50)
    query.add_argument("--cursor", help="next_cursor of the previous page")
    _format_option(query)
    query.set_defaults(handler=_reporting(_query))

    show = actions.add_parser("show", parents=[common],
                              help="one record with its stages, each with its step (attempt, start, tokens, hashes)")
    show.add_argument("record_id")
    show.add_argument("--spec", action="store_true",
                      help="print the pipeline file (YAML) that served the record instead, as it was then")
    show.set_defaults(handler=_reporting(_show))

    summary = actions.add_parser("summary", parents=[common], help="counts, block rate, tokens and cost, grouped")
    summary.add_argument("--group-by", default="pipeline", choices=["pipeline", "model", "key_id", "day"])
    _filter_options(summary, FILTER_FIELDS)
    _format_option(summary)
    summary.set_defaults(handler=_reporting(_summary))

    verify = actions.add_parser("verify", parents=[common], help="recompute the hash chain; exit 1 on any finding")
    _filter_options(verify, {name: FILTER_FIELDS[name] for name in RANGE_FIELDS})
    verify.add_argument("--workers", type=_positive, metavar="N",
                        help="processes that recompute hashes in parallel (default: one per CPU, for "
                             "spans of 40,000+ records; 1: this process only)")
    verify.add_argument("--public-key", action="append", default=[], metavar="FILE",
                        help="an Ed25519 public key (PEM) that checks checkpoints and digests; repeat it for the "
                             "keys before a rotation. No secret is needed. The config's keys, and the public key "
                             "a server made beside a SQLite database, are used as well")
    verify.add_argument("--anchors", metavar="DIR",
                        help="check the database against the digest files in DIR: a cut tail, an older copy "
                             "restored, a range rewritten, a digest missing or altered (default: audit.anchors.dir, "
                             "else the folder a server made beside a SQLite database)")
    verify.set_defaults(handler=_reporting(_verify))

    keygen = actions.add_parser("keygen", help="write a new Ed25519 key pair for signing checkpoints",
                                description="Write an Ed25519 private key (PEM, mode 600) to FILE and its public "
                                            "key to FILE.pub. The server signs with the private key "
                                            "(INFERLINE_AUDIT__SIGNING_KEY_FILE=FILE); reviewers verify with the "
                                            "public one. To rotate, keep the old .pub in audit.public_keys.")
    keygen.add_argument("--out", required=True, metavar="FILE", help="where the private key goes (must not exist)")
    keygen.set_defaults(handler=_keygen)

    report = actions.add_parser("report", parents=[common], help="a period's report for reviewers (HTML or JSON)",
                                description="Requests by pipeline, version and model; policy blocks by rule; "
                                            "errors; cost by key, tenant and pipeline; the chain's (and with "
                                            "--anchors, the digests') verification; who read the log. For a "
                                            "quarterly review or an incident. HTML is one self-contained file.")
    _filter_options(report, {name: FILTER_FIELDS[name] for name in ("since", "until", "pipeline")})
    report.add_argument("--format", choices=("html", "json"), default="html", help="html (default) or json")
    report.add_argument("--public-key", action="append", default=[], metavar="FILE",
                        help="an Ed25519 public key that checks the checkpoints (repeatable)")
    report.add_argument("--anchors", metavar="DIR", help="also check the database against the digests in DIR "
                                                         "(default: audit.anchors.dir, else the folder a server "
                                                         "made beside a SQLite database)")
    report.add_argument("--output", "-o", metavar="FILE", help="write here instead of stdout")
    report.set_defaults(handler=_reporting(_report))

    erase = actions.add_parser("erase", parents=[common], help="make a subject's encrypted content unreadable",
                               description="Destroy the data keys of SUBJECT (content: encrypted records): their "
                                           "content can no longer be read, the records and the chain stay and "
                                           "verify, and a chained erasure record says who erased what, when. "
                                           "Refused while any of the subject's records is on legal hold.")
    erase.add_argument("--subject", required=True,
                       help="key:KEY_ID, tenant:NAME or tags.FIELD:VALUE, as the audit stage's subject: names it")
    erase.add_argument("--by", default=os.environ.get("USER") or "cli",
                       help="who asks (kept in the erasure record; default: $USER)")
    erase.set_defaults(handler=_reporting(_erase))

    export = actions.add_parser("export", parents=[common], help="export records to stdout")
    export.add_argument("--format", default="jsonl", choices=["jsonl", "csv"])
    _filter_options(export, FILTER_FIELDS)
    export.set_defaults(handler=_reporting(_export))

    access = actions.add_parser("access", parents=[common], help="the reviewers' access log: who read the "
                                                                 "audit log, newest first")
    _filter_options(access, ACCESS_FIELDS)
    access.add_argument("--limit", type=int, default=50)
    access.add_argument("--cursor", help="next cursor of the previous page")
    _format_option(access)
    access.set_defaults(handler=_reporting(_access))

    prune = actions.add_parser("prune", parents=[common],
                               help="delete records past their pipeline's retention_days (not on hold)")
    prune.set_defaults(handler=_reporting(_prune))

    hold = actions.add_parser("hold", parents=[common], help="put records on legal hold (or --release them)")
    target = hold.add_mutually_exclusive_group(required=True)
    target.add_argument("--pipeline")
    target.add_argument("--record", nargs="+", dest="records", metavar="ID")
    hold.add_argument("--release", action="store_true", help="take them off hold instead")
    hold.set_defaults(handler=_reporting(_hold))


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {value!r}")
    return number


def _reporting(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """*handler*, with a bad filter, sort or cursor (ValueError) or an unreachable database as one line and exit 1."""
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except BrokenPipeError:  # the reader of stdout stopped early (| head): done, as cat would be
            _drop_stdout()
            return 0
        except ValueError as exc:
            print(f"inferline: {exc}", file=sys.stderr)
        except sa.exc.SQLAlchemyError as exc:
            # The URL may carry a password: only the first line of the driver's error, never the URL.
            reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
            print(f"inferline: audit database: {reason}", file=sys.stderr)
        finally:
            # Connections closed here, not left to the garbage collector (main() may run in-process).
            for engine in getattr(args, "engines", []):
                engine.dispose()
        return 1
    return run


def _drop_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for the closed pipe would fail again at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor has no pipe either
            os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def check(value: str) -> Any:
        try:
            return parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return check


def _filter_options(parser: argparse.ArgumentParser, fields: dict[str, str]) -> None:
    """One option per filter of *fields* (FILTER_FIELDS, ACCESS_FIELDS or a part), checked as the API checks it."""
    for name, help_text in fields.items():
        kind = {"since": _checked(parse_time), "until": _checked(parse_time), "min_cost_usd": _checked(parse_cost)}
        metavar = {"since": "T", "until": "T", "min_cost_usd": "USD"}.get(name, name.upper())
        parser.add_argument("--" + name.replace("_", "-"), type=kind.get(name, str), metavar=metavar,
                            help=help_text)


def _format_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=FORMATS,
                        help="table (default on a terminal), jsonl (default otherwise) or csv")


def _reader(args: argparse.Namespace) -> AuditReader:
    """What the listings and verify need: no spool; the config's keys (and ``--public-key``) check checkpoints,
    its master key decrypts."""
    workspace, engine = _open(args)
    return AuditReader(engine, checkpoint_key=_verifier(args, workspace, engine),
                       vault=content_vault(workspace.server, engine))


def _logged(reader: AuditReader, action: str, query: dict[str, Any]) -> None:
    """Write this read to the access log, as the API and the console write theirs: role ``cli`` (no key id:
    whoever reaches the database), the *query* as asked (times in ISO 8601, unset ones left out)."""
    reader.log_access(None, "cli", action, {name: value.isoformat() if isinstance(value, datetime) else value
                                            for name, value in query.items() if value is not None})


def _verifier(args: argparse.Namespace, workspace: Workspace, engine: sa.Engine) -> Verifier:
    """The config's keys, the public key a server made beside the database (if any) and ``--public-key``."""
    server = workspace.server
    local = local_key(server, engine.url)
    try:
        given = [Path(name).read_bytes() for name in getattr(args, "public_key", [])]
        if local is not None and local.public.exists():
            given.append(local.public.read_bytes())
    except OSError as exc:
        raise ValueError(f"public key: {exc}") from None
    return Verifier.for_signer(checkpoint_signer(server), [*public_keys(server, workspace.root), *given])


def _anchor_folder(args: argparse.Namespace, workspace: Workspace, engine: sa.Engine) -> Path | None:
    """``--anchors``, else ``audit.anchors.dir``, else the folder a server made beside the database with its key
    (none before a server has made one)."""
    if args.anchors:
        return Path(args.anchors)
    server = workspace.server
    local = local_key(server, engine.url)
    if server.audit.anchors is None and local is not None and not (local.public.exists() or local.digests.exists()):
        return None
    return anchor_folder(server, workspace.root, engine.url)


def _tail(tail: Tail, now: datetime) -> str:
    """"the last 3 record(s) (seq 18..20), written in the last 2 s\""""
    return (f"the last {tail.count} record(s) (seq {tail.first_seq}..{tail.last_seq}), written in the last "
            f"{age_text(tail.age_s(now))}")


def _maintenance(args: argparse.Namespace) -> AuditMaintenance:
    """What prune and hold need: the config's checkpoint key signs a checkpoint that a prune marker lands on."""
    workspace, engine = _open(args)
    return AuditMaintenance(engine, checkpoint_key=checkpoint_signer(workspace.server),
                            checkpoint_every=workspace.server.audit.checkpoint_every)


def _open(args: argparse.Namespace) -> tuple[Workspace, sa.Engine]:
    workspace = open_workspace(args.config)
    engine = open_engine(database_url(args))
    args.engines = [*getattr(args, "engines", []), engine]  # closed by _reporting once the action is done
    return workspace, engine


def _filters(args: argparse.Namespace, fields: Sequence[str] = tuple(FILTER_FIELDS)) -> AuditFilters:
    return parse_filters({name: getattr(args, name, None) for name in fields}, tuple(fields))


def _format(args: argparse.Namespace) -> str:
    return args.format or ("table" if sys.stdout.isatty() else "jsonl")


def _print_rows(rows: list[dict[str, Any]], fmt: str, table: Callable[[dict[str, Any]], dict[str, str]],
                none: str = NO_MATCH) -> None:
    """*rows* as JSON lines, CSV (their own columns) or a table (the columns *table* picks)."""
    if not rows:
        print(none, file=sys.stdout if fmt == "table" else sys.stderr)
        return
    if fmt == "jsonl":
        for row in rows:
            print(json.dumps(row, default=str))
    elif fmt == "csv":
        writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in row.items()}
                         for row in rows)
    else:
        cells = [table(row) for row in rows]
        lines = [list(cells[0])] + [[str(value) for value in cell.values()] for cell in cells]
        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
        for line in lines:
            print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


def _key(row: dict[str, Any]) -> str:
    if not row.get("key_id"):
        return "-"
    return f"{row['key_id']} ({row['key_name']})" if row.get("key_name") else row["key_id"]


def _record_cells(row: dict[str, Any]) -> dict[str, str]:
    return {"received (UTC)": str(row["received_at"])[:19].replace("T", " "), "pipeline": row["pipeline"],
            "status": row["status"], "model": row.get("model") or "-", "key": _key(row),
            "tokens in/out": f"{row['input_tokens']}/{row['output_tokens']}", "cost_usd": f"{row['cost_usd']:.6f}",
            "ms": f"{row['duration_ms']:.0f}", "id": row["id"]}


def _query(args: argparse.Namespace) -> int:
    reader, filters = _reader(args), _filters(args)
    _logged(reader, "query", {**filters.given(), "sort": args.sort, "cursor": args.cursor, "limit": args.limit})
    page = reader.query(filters, sort=args.sort, cursor=args.cursor, limit=args.limit)
    _print_rows(page.records, _format(args), _record_cells)
    if page.next_cursor:
        print(f"more: --cursor {page.next_cursor}", file=sys.stderr)
    return 0


def _show(args: argparse.Namespace) -> int:
    reader = _reader(args)
    _logged(reader, "show spec" if args.spec else "show", {"record_id": args.record_id})
    found = reader.get(args.record_id)
    if found is None:
        print(f"inferline: no audit record {args.record_id!r}", file=sys.stderr)
        return 1
    if not args.spec:
        found = reader.reveal(found, None, "cli")  # content: encrypted, decrypted (and the read logged)
        print(json.dumps(found, indent=2, default=str))
        return 0
    version = PipelineVersions(reader.engine).by_sha256(found["spec_sha256"], found["pipeline"])
    if version is None:
        print(f"inferline: version {found['spec_sha256'][:12]} of pipeline {found['pipeline']!r} is not in the "
              "database (only pipelines loaded by a server since versions are kept are)", file=sys.stderr)
        return 1
    print(f"# {version.name} version {version.label}, sha256 {version.spec_sha256}, from {version.source}, "
          f"deployed by {version.deployed_by} at {version.deployed_at.isoformat()}")
    sys.stdout.write(version.text if version.text.endswith("\n") else version.text + "\n")
    return 0


def _summary(args: argparse.Namespace) -> int:
    reader, filters = _reader(args), _filters(args)
    _logged(reader, "summary", {"group_by": args.group_by, **filters.given()})
    groups = reader.summary(filters, args.group_by)

    def cells(group: dict[str, Any]) -> dict[str, str]:
        key = _key(group) if args.group_by == "key_id" else str(group[args.group_by] or "-")
        return {args.group_by.replace("_id", ""): key, "count": str(group["count"]), "denied": str(group["denied"]),
                "block_rate": f"{group['block_rate']:.1%}", "tokens in/out":
                f"{group['input_tokens']}/{group['output_tokens']}", "cost_usd": f"{group['cost_usd']:.6f}"}
    _print_rows(groups, _format(args), cells)
    return 0


def _verify(args: argparse.Namespace) -> int:
    filters = _filters(args, RANGE_FIELDS)
    workspace, engine = _open(args)
    audit, window_s = workspace.server.audit, exposure_window_s(workspace.server)
    verifier = _verifier(args, workspace, engine)
    folder = _anchor_folder(args, workspace, engine)
    reader = AuditReader(engine, checkpoint_key=verifier, checkpoint_window_s=window_s)
    _logged(reader, "verify", filters.given())
    report = reader.verify(filters.since, filters.until, workers=args.workers)
    now = datetime.now(UTC)
    for finding in report.findings:
        print(f"{finding.kind}: seq {finding.seq} record {finding.record_id}: {finding.detail}")
    verdict = "ok" if report.ok else f"FAILED ({len(report.findings)} finding(s))"
    print(f"{verdict}: {report.checked} record(s) checked, head seq {report.head_seq}")
    if report.unchecked_checkpoints:
        print(f"note: {report.unchecked_checkpoints} checkpoint(s) not checked: no key given for their algorithm or "
              "key id (--public-key, or the config's checkpoint_key for HMAC)")
    if verifier.empty and local_key(workspace.server, engine.url) is not None:
        print("note: no server has made its signing key beside this database yet: checkpoints and digests not "
              "checked")
    if report.uncovered is not None and not any(f.kind == "missing_checkpoint" for f in report.findings):
        print(f"note: {_tail(report.uncovered, now)}, are not yet covered by a signed checkpoint (a server holding "
              f"the key signs the head every {audit.checkpoint_every_s:g} s)")
    if folder is None:
        return 0 if report.ok else 1
    try:
        anchored = verify_anchors(engine, folder, verifier, now=now, window_s=window_s)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    alone = " (the database alone does not show this)" if report.ok else ""
    for found in anchored.findings:
        print(f"{found.kind}: seq {found.seq}: {found.detail}{alone}")
    verdict = "ok" if anchored.ok else f"FAILED ({len(anchored.findings)} finding(s))"
    print(f"anchors {verdict}: {anchored.digests} digest(s), the newest of seq {anchored.anchored_seq}")
    if anchored.unchecked:
        print(f"note: {anchored.unchecked} digest(s) not checked: no key given for them")
    if anchored.unanchored is not None:
        print(f"note: {_tail(anchored.unanchored, now)}, are not yet anchored (a digest follows within "
              f"{window_s:g} s while a server holding the key runs)")
    return 0 if report.ok and anchored.ok else 1


def _report(args: argparse.Namespace) -> int:
    workspace, engine = _open(args)
    folder = _anchor_folder(args, workspace, engine)
    reader = AuditReader(engine, checkpoint_key=_verifier(args, workspace, engine))
    _logged(reader, "report", {"since": args.since, "until": args.until, "pipeline": args.pipeline})
    try:
        report = reader.report(_filters(args, ("since", "until", "pipeline")), folder)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    from serving.console.render import report_file  # the console's templates: litestar and the app's state

    text = json.dumps(report, indent=2, default=str) + "\n" if args.format == "json" else report_file(report)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _erase(args: argparse.Namespace) -> int:
    workspace, engine = _open(args)
    vault = content_vault(workspace.server, engine)
    if vault is None:
        raise ValueError("no audit.master_key is configured (INFERLINE_AUDIT__MASTER_KEY_FILE): there is no "
                         "encrypted content to erase")
    maintenance = AuditMaintenance(engine, checkpoint_key=checkpoint_signer(workspace.server),
                                   checkpoint_every=workspace.server.audit.checkpoint_every)
    report = maintenance.erase(vault, args.subject, args.by)
    print(f"erased subject {report.subject_id[:16]}: the content of {report.records} record(s) can no longer be "
          f"read ({report.keys_destroyed} data key(s) destroyed); erasure record {report.record_id}")
    return 0


def _keygen(args: argparse.Namespace) -> int:
    out = Path(args.out)
    public = out.with_name(out.name + ".pub")
    for path in (out, public):
        if path.exists():
            print(f"inferline audit keygen: {path} exists; a signing key is never overwritten", file=sys.stderr)
            return 1
    private_pem, public_pem = generate_pem()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(private_pem)
    public.write_bytes(public_pem)
    print(f"wrote {out} (private: INFERLINE_AUDIT__SIGNING_KEY_FILE={out}) and {public} (key id "
          f"{Ed25519Signer.from_pem(private_pem).key_id})")
    return 0


def _export(args: argparse.Namespace) -> int:
    reader, filters, count = _reader(args), _filters(args), 0
    _logged(reader, "export", {"format": args.format, **filters.given()})
    for line in reader.export(filters, args.format):
        sys.stdout.write(line if line.endswith("\n") else line + "\n")
        count += 1
    if count <= (1 if args.format == "csv" else 0):  # the CSV header alone
        print(NO_MATCH, file=sys.stderr)
    return 0


def _access(args: argparse.Namespace) -> int:
    filters = parse_access_filters({name: getattr(args, name) for name in ACCESS_FIELDS})
    reader = _reader(args)
    _logged(reader, "access", {**filters.given(), "cursor": args.cursor, "limit": args.limit})
    page = reader.access(filters, cursor=args.cursor, limit=args.limit)

    def cells(entry: dict[str, Any]) -> dict[str, str]:
        return {"at (UTC)": str(entry["at"])[:19].replace("T", " "), "key": _key(entry), "role": entry["role"] or "-",
                "action": entry["action"], "query": json.dumps(entry["query"], sort_keys=True)}
    _print_rows(page.records, _format(args), cells, none="no access-log entries match")
    if page.next_cursor:
        print(f"more: --cursor {page.next_cursor}", file=sys.stderr)
    return 0


def _prune(args: argparse.Namespace) -> int:
    report = _maintenance(args).prune(retention_days(open_workspace(args.config)))
    print(f"pruned {report.deleted} record(s); marker {report.marker_id}")
    return 0


def _hold(args: argparse.Namespace) -> int:
    count = _maintenance(args).set_hold(pipeline=args.pipeline, record_ids=args.records, on=not args.release)
    print(f"{'released' if args.release else 'held'} {count} record(s)")
    return 0


def retention_days(workspace: Workspace) -> dict[str, int]:
    """Each pipeline's retention, from its audit stage's ``retention_days``."""
    days = {}
    for loaded in workspace.load_pipelines():
        for plan in loaded.plans:
            if plan.spec.type == "audit":
                days[loaded.spec.name] = plan.config.retention_days  # type: ignore[attr-defined]
    return days
