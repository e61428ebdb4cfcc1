"""``inferline schema``: the JSON Schema of the pipeline file or of the server file, for editors.

    inferline schema pipeline                       this server's stage types, its plugins included
    inferline schema pipeline -o my.schema.json     into a file a pipeline's first line points at
    inferline schema pipeline --builtin             built-in stage types only: what schemas/ ships
    inferline schema server                         inferline.yaml's

A YAML file opts in with a first line that VS Code's YAML extension and JetBrains IDEs read::

    # yaml-language-server: $schema=../schemas/pipeline.schema.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.registry import StageRegistry
from pipeline.schema import dumps, pipeline_schema
from serving.cli.common import EXIT_OK, Subcommands, config_option
from serving.config.schema import server_schema
from serving.runtime.workspace import open_workspace
from stages import register_builtins


def add_schema_parser(subparsers: Subcommands) -> None:
    schema = subparsers.add_parser(
        "schema", help="print the JSON Schema of pipeline files or of inferline.yaml, for editors",
        description="Print the JSON Schema (draft-07) of a pipeline file or of the server file, generated from "
                    "the models that validate them: every key and option with its description, a stage's "
                    "with: options chosen by its type:, and a misspelt key an error. Point a YAML file at it "
                    "with a first line '# yaml-language-server: $schema=PATH' and VS Code (YAML extension) or "
                    "a JetBrains IDE completes and checks it as you type. The pipeline schema includes the "
                    "stage types of the server config's plugins: and entry points; schemas/ in the repository "
                    "holds the built-in ones (make schemas).")
    schema.add_argument("file", choices=["pipeline", "server"],
                        help="pipeline: a file of the pipelines folder; server: inferline.yaml")
    config_option(schema)
    schema.add_argument("--builtin", action="store_true",
                        help="pipeline: the built-in stage types only, without the server's plugins (what "
                             "schemas/pipeline.schema.json holds)")
    schema.add_argument("--output", "-o", metavar="FILE", help="write it to FILE instead of stdout")
    schema.set_defaults(handler=_schema)
    return schema


def _schema(args: argparse.Namespace) -> int:
    if args.file == "server":
        schema = server_schema()
    else:
        registry = register_builtins(StageRegistry()) if args.builtin else open_workspace(args.config).registry
        schema = pipeline_schema(registry)
    text = dumps(schema)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK
