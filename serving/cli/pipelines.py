"""``inferline pipelines``: ship pipeline versions to a running server, by URL and admin key.

    inferline pipelines versions support                      # every version kept, which one serves
    inferline pipelines deploy support pipelines/support.yaml # a new version, served at once
    inferline pipelines deploy support v4.yaml --keep         # kept, not served: for a split, shadow or pin
    inferline pipelines activate support 3f0c2a               # a kept version, by spec hash (6+ characters)
    inferline pipelines rollback support                      # the version before the serving one
    inferline pipelines retire support                        # stop serving it (versions stay kept)
    inferline pipelines split support 3=95 4=5                # a canary: 5% of caller keys on version 4
    inferline pipelines split support --clear                 # all traffic back to the active version
    inferline pipelines promote support                       # the canary becomes the active version
    inferline pipelines shadow support 4 10                   # 10% of requests also run on version 4
    inferline pipelines shadow support --clear                # no more shadow runs

The server's own routes (``/pipelines/{name}/versions``, ``/activate``, ``/rollback``, ``DELETE``;
serving/http/deploy_routes.py) do the work; each action is an audit record. Not ``inferline deploy``,
which writes a Ray Serve config file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from serving.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Subcommands

ENV_URL, ENV_KEY = "INFERLINE_URL", "INFERLINE_API_KEY"


def add_pipelines_parser(subparsers: Subcommands) -> None:
    """Add ``pipelines`` and its actions to *subparsers*."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=os.environ.get(ENV_URL, "http://127.0.0.1:8000"),
                        help=f"the server (default: ${ENV_URL}, else http://127.0.0.1:8000)")
    common.add_argument("--key", default=os.environ.get(ENV_KEY),
                        help=f"an admin API key (default: ${ENV_KEY}; none when the server's auth is off)")
    common.add_argument("--json", action="store_true", help="print the server's JSON answer")
    pipelines = subparsers.add_parser(
        "pipelines", help="deploy, activate, roll back and retire pipeline versions on a running server",
        description="Ship pipeline versions through a running server's API (admin key). The server checks "
                    "a version as it checks a file, writes it to its pipelines folder and serves it at once; "
                    "every action is an audit record.")
    actions = pipelines.add_subparsers(dest="pipelines_command", metavar="ACTION", required=True)
    versions = actions.add_parser("versions", parents=[common], help="list a pipeline's kept versions")
    versions.add_argument("name")
    deploy = actions.add_parser("deploy", parents=[common], help="deploy a pipeline file as a new version")
    deploy.add_argument("name")
    deploy.add_argument("file", type=Path, help="the pipeline file (its name: must be NAME)")
    deploy.add_argument("--keep", action="store_true",
                        help="check and keep the version without serving it (for split, shadow or a pin)")
    activate = actions.add_parser("activate", parents=[common], help="serve a kept version again")
    activate.add_argument("name")
    activate.add_argument("spec_sha256", metavar="VERSION",
                          help="the version's spec hash (six or more characters of it), or its version: label")
    rollback = actions.add_parser("rollback", parents=[common], help="serve the version before the serving one")
    rollback.add_argument("name")
    retire = actions.add_parser("retire", parents=[common], help="stop serving a pipeline")
    retire.add_argument("name")
    split = actions.add_parser("split", parents=[common], help="split traffic between versions (a canary)")
    split.add_argument("name")
    split.add_argument("weights", nargs="*", metavar="VERSION=WEIGHT",
                       help="a version (label or spec hash prefix) and its weight, e.g. 3=95 4=5")
    split.add_argument("--clear", action="store_true", help="all traffic back to the active version")
    promote = actions.add_parser("promote", parents=[common], help="make the canary the active version")
    promote.add_argument("name")
    shadow = actions.add_parser("shadow", parents=[common],
                                help="mirror a share of requests onto a candidate version (never answered)")
    shadow.add_argument("name")
    shadow.add_argument("version", nargs="?", help="the candidate: a kept version's label or spec hash prefix")
    shadow.add_argument("percent", nargs="?", type=float, help="the share of requests mirrored, above 0 up to 100")
    shadow.add_argument("--clear", action="store_true", help="stop mirroring")
    pipelines.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    name = args.name
    if args.pipelines_command == "versions":
        call = ("GET", f"/pipelines/{name}/versions", None)
    elif args.pipelines_command == "deploy":
        try:
            text = args.file.read_text()
        except OSError as exc:
            print(f"inferline pipelines: cannot read {args.file}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        call = ("POST", f"/pipelines/{name}/versions", {"yaml": text, "activate": not args.keep})
    elif args.pipelines_command == "activate":
        call = ("POST", f"/pipelines/{name}/activate", {"spec_sha256": args.spec_sha256})
    elif args.pipelines_command == "rollback":
        call = ("POST", f"/pipelines/{name}/rollback", None)
    elif args.pipelines_command == "promote":
        call = ("POST", f"/pipelines/{name}/promote", None)
    elif args.pipelines_command == "split":
        if args.clear == bool(args.weights):
            print("inferline pipelines split: give VERSION=WEIGHT pairs, or --clear", file=sys.stderr)
            return EXIT_USAGE
        try:
            weights = {version: int(weight) for version, _, weight in (w.partition("=") for w in args.weights)}
        except ValueError:
            print("inferline pipelines split: weights are VERSION=WEIGHT with a whole number", file=sys.stderr)
            return EXIT_USAGE
        call = ("DELETE", f"/pipelines/{name}/traffic", None) if args.clear else \
            ("PUT", f"/pipelines/{name}/traffic", {"weights": weights})
    elif args.pipelines_command == "shadow":
        if args.clear == (args.version is not None) or (args.version is not None and args.percent is None):
            print("inferline pipelines shadow: give VERSION PERCENT, or --clear", file=sys.stderr)
            return EXIT_USAGE
        call = ("DELETE", f"/pipelines/{name}/shadow", None) if args.clear else \
            ("PUT", f"/pipelines/{name}/shadow", {"version": args.version, "percent": args.percent})
    else:
        call = ("DELETE", f"/pipelines/{name}", None)
    method, path, body = call
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    try:
        response = httpx.request(method, args.url.rstrip("/") + path, json=body, headers=headers, timeout=60,
                                 trust_env=False)
    except httpx.HTTPError as exc:
        print(f"inferline pipelines: {args.url}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    answer: Any = response.json() if response.headers.get("content-type", "").endswith("json") else {}
    if response.status_code >= 400:
        detail = answer.get("detail") or response.text[:500]
        print(f"inferline pipelines: {response.status_code} {answer.get('title', '')}: {detail}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        _print(args.pipelines_command, answer)
        for warning in answer.get("warnings", []):
            print(f"warning: {warning}", file=sys.stderr)
    return EXIT_OK


def _print(command: str, answer: dict[str, Any]) -> None:
    if command == "versions":
        for version in answer["versions"]:
            mark = "*" if version["active"] else " "
            print(f"{mark} {version['spec_sha256'][:12]}  version {version['version']:<8} {version['deployed_at']}"
                  f"  by {version['deployed_by']}  {version['source']}")
    elif command == "retire":
        print(f"retired {answer['pipeline']}")
    elif command == "split":
        weights = answer["weights"]
        print(f"{answer['pipeline']}: " + (", ".join(f"{sha[:12]} {w}" for sha, w in sorted(weights.items()))
                                           if weights else "all traffic to the active version"))
    elif command == "shadow":
        shadow = answer["shadow"]
        print(f"{answer['pipeline']}: " + (f"{shadow['percent']:g}% of requests also run on version "
                                           f"{shadow['version']} ({shadow['spec_sha256'][:12]})"
                                           if shadow else "no shadow"))
    elif command == "deploy" and "previous_spec_sha256" not in answer:
        print(f"{answer['pipeline']}: version {answer['version']} ({answer['spec_sha256'][:12]}) kept, not served")
    else:
        print(f"{answer['pipeline']} now serves version {answer['version']} ({answer['spec_sha256'][:12]})"
              + (f", was {answer['previous_spec_sha256'][:12]}" if answer.get("previous_spec_sha256") else ""))
