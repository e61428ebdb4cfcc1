"""``inferline keys``: create, list and revoke the API keys of the HTTP API.

    inferline keys create --role caller --name "support bot" [--tenant acme]   # prints the key, once
    inferline keys list
    inferline keys revoke KEY_ID

The database is ``--database URL``, else ``$INFERLINE_DATABASE``, else the
``database:`` of the server config (default ``sqlite:///inferline.db``; a
relative SQLite path is taken from the config file's folder, as the server does).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from serving.cli.common import EXIT_FAILED, EXIT_OK, Subcommands
from serving.runtime.database import open_database
from serving.runtime.workspace import open_workspace
from store.keys import ROLES, KeyInfo, KeyStore

ENV_DATABASE = "INFERLINE_DATABASE"


def add_keys_parser(subparsers: Subcommands) -> None:
    """Add ``keys`` and its actions to *subparsers*; each action sets ``handler(args) -> exit code``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", metavar="FILE",
                        help="server config (default: $INFERLINE_CONFIG, else ./inferline.yaml if present, "
                             "else built-in defaults)")
    common.add_argument("--database", metavar="URL",
                        help="database URL, e.g. sqlite:///inferline.db or postgresql://user@host/db "
                             f"(default: ${ENV_DATABASE}, else 'database:' of the server config)")

    keys = subparsers.add_parser(
        "keys", help="create, list and revoke API keys",
        description="Manage the API keys that callers send as 'Authorization: Bearer <key>'. "
                    f"Roles: {', '.join(ROLES)}. Only a hash of each key is stored.")
    actions = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)

    create = actions.add_parser(
        "create", parents=[common], help="create a key and print it, once",
        description="Create an API key and print it on stdout. It is stored hashed and cannot be shown "
                    "again: hand it to its holder now.")
    create.add_argument("--role", required=True, choices=ROLES,
                        help="caller: call pipelines; auditor: read audits and metrics; admin: everything")
    create.add_argument("--name", required=True, metavar="NAME", help="who or what holds the key, e.g. 'support bot'")
    create.add_argument("--tenant", metavar="TENANT",
                        help="whose requests the key makes: rate limits and budgets with per: tenant, fair "
                             "share in the engine's queue and isolate_tenants count by it, and several keys "
                             "may share one (default: NAME)")
    create.set_defaults(handler=_create)

    listing = actions.add_parser("list", parents=[common], help="list keys (never their secrets)",
                                 description="List every key, revoked ones included: id, name, tenant, "
                                             "role, created, status, last used (times in UTC).")
    listing.set_defaults(handler=_list)

    revoke = actions.add_parser("revoke", parents=[common], help="revoke a key by its id",
                                description="Revoke the key KEY_ID (the id column of 'keys list'). Exits 1 "
                                            "if there is no such key or it was already revoked.")
    revoke.add_argument("key_id", metavar="KEY_ID")
    revoke.set_defaults(handler=_revoke)


def database_url(args: argparse.Namespace) -> str:
    """``--database``, else ``$INFERLINE_DATABASE``, else the server config's ``database:``."""
    if args.database:
        return args.database
    if os.environ.get(ENV_DATABASE):
        return os.environ[ENV_DATABASE]
    return open_workspace(args.config).database_url


def _create(args: argparse.Namespace) -> int:
    def run(keys: KeyStore) -> int:
        info, plaintext = keys.create(args.name, args.role, args.tenant)
        print(plaintext, flush=True)
        print(f"created key {info.id} ({info.role}) for {info.name!r}, tenant {info.tenant!r}; "
              "it will not be shown again, "
              "store it now", file=sys.stderr)
        return EXIT_OK
    return _with_store(args, run)


def _list(args: argparse.Namespace) -> int:
    def run(keys: KeyStore) -> int:
        infos = keys.list()
        if not infos:
            print("no API keys", file=sys.stderr)
            return EXIT_OK
        rows = [("id", "name", "tenant", "role", "created", "status", "last used")]
        rows += [(k.id, k.name, k.tenant, k.role, _when(k.created_at), _status(k), _when(k.last_used_at))
                 for k in infos]
        _print_table(rows)
        return EXIT_OK
    return _with_store(args, run)


def _revoke(args: argparse.Namespace) -> int:
    def run(keys: KeyStore) -> int:
        if not keys.revoke(args.key_id):
            print(f"inferline: no active key {args.key_id!r}: unknown or already revoked "
                  "(see 'inferline keys list')", file=sys.stderr)
            return EXIT_FAILED
        print(f"revoked {args.key_id}")
        return EXIT_OK
    return _with_store(args, run)


def _with_store(args: argparse.Namespace, run: Callable[[KeyStore], int]) -> int:
    url = database_url(args)
    try:
        with _open_store(url) as keys:
            return run(keys)
    except ValueError as exc:
        print(f"inferline: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except sa.exc.SQLAlchemyError as exc:
        # The URL may carry a password: show it masked, and only the first line of the driver's error.
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        print(f"inferline: database {_masked(url)}: {reason}", file=sys.stderr)
        return EXIT_FAILED


@contextmanager
def _open_store(url: str) -> Iterator[KeyStore]:
    with open_database(url) as engine:
        yield KeyStore(engine)


def _masked(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "(unparsable URL)"


def _when(moment: datetime | None) -> str:
    return "-" if moment is None else moment.strftime("%Y-%m-%d %H:%M")


def _status(info: KeyInfo) -> str:
    return "active" if info.revoked_at is None else f"revoked {_when(info.revoked_at)}"


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
