"""The ``inferline`` command line.

    inferline serve [--config FILE] [--host H] [--port P] [--ray]   serve every pipeline over HTTP
    inferline deploy [--config FILE] [--output serve.yaml]  write a Ray Serve config for `serve deploy`
    inferline validate PATH...                  check pipeline files (or folders of them)
    inferline schema pipeline|server [-o FILE]  the JSON Schema of pipeline files or inferline.yaml, for editors
    inferline run PIPELINE --input TEXT [--tag K=V] [--param K=V]   run one request in-process
    inferline keys create|list|revoke           manage API keys
    inferline audit query|show|summary|verify|export|access|prune|hold   read and keep the audit log
    inferline eval PIPELINE --dataset FILE.jsonl [--baseline RUN]   evaluate quality, latency and cost
    inferline load PIPELINE --rate R --duration D ...  drive a live server with Poisson arrivals
    inferline profile MODEL                     measure the engine's prefill and decode step costs
    inferline plan --workload FILE              replicas and cost needed to meet the pipeline's SLOs
    inferline --version
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline import __version__
from pipeline.errors import InferlineError, SpecError
from serving.cli.audit import add_audit_parser
from serving.cli.capacity import add_capacity_parser
from serving.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, config_option
from serving.cli.eval import add_eval_parser
from serving.cli.index import add_index_parser
from serving.cli.keys import add_keys_parser
from serving.cli.pipelines import add_pipelines_parser
from serving.cli.replay import add_replay_parser
from serving.cli.run import add_run_parser
from serving.cli.schema import add_schema_parser
from serving.runtime.pipeline_set import PipelineSet, declared_names, pipeline_files
from serving.runtime.workspace import open_workspace


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.handler(args)
    except SpecError as exc:
        for issue in exc.issues:
            print(issue, file=sys.stderr)
        return EXIT_FAILED
    except (InferlineError, FileNotFoundError) as exc:
        print(f"inferline: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferline", description="Serve YAML-declared AI pipelines.",
        epilog="Exit codes: 0 success, 1 invalid spec or failed request, 2 usage error.")
    parser.add_argument("--version", action="version", version=f"inferline {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve every pipeline over HTTP (and the OpenAI-compatible API)",
                           description="Load the server config and every pipeline (refusing to start if any is "
                                       "invalid), start one engine per model, and serve. Settings come from "
                                       "the config, then INFERLINE_* environment variables, then these flags. Besides "
                                       "POST /pipelines/NAME: the OpenAI API (/v1), Anthropic's (/v1/messages), "
                                       "and MCP at /mcp, where each pipeline a key may call is a tool.")
    config_option(serve)
    serve.add_argument("--host", help="address to bind (default: http.host, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: http.port, 8000)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--ray", action="store_true",
                       help="run the backend: ray models' engines on Ray Serve (a local Ray unless "
                            "RAY_ADDRESS names a cluster) and reach them through deployment handles")
    serve.set_defaults(handler=_serve)

    deploy = sub.add_parser("deploy", help="write a Ray Serve config file for `serve deploy`",
                            description="Write the Ray Serve config of the server: the HTTP ingress and one "
                                        "deployment per backend: ray model, with its ray: replicas, "
                                        "autoscaling and resources. Deploy it with `serve deploy FILE`.")
    config_option(deploy)
    deploy.add_argument("--output", "-o", default="serve.yaml", metavar="FILE",
                        help="where to write it (default: serve.yaml)")
    deploy.set_defaults(handler=_deploy)

    validate = sub.add_parser("validate", help="check pipeline files; print every error with its line",
                              description="Validate pipeline YAML files against the server config, as serve "
                                          "loads them: every key, stage options, when: expressions, roles, "
                                          "output: constraints (compiled), and no two files of one name:. "
                                          "Prints 'ok' per valid file on stdout and every error on "
                                          "stderr as FILE:LINE:COL: LOC: MESSAGE; exits 1 if any is invalid.")
    validate.add_argument("paths", nargs="+", metavar="PATH", help="a pipeline file, or a folder of them")
    config_option(validate)
    validate.set_defaults(handler=_validate)

    add_schema_parser(sub)
    add_run_parser(sub)
    add_keys_parser(sub)
    add_pipelines_parser(sub)
    add_audit_parser(sub)
    add_index_parser(sub)
    add_eval_parser(sub)
    add_replay_parser(sub)
    add_capacity_parser(sub)
    return parser


def _serve(args: argparse.Namespace) -> int:
    import logging
    import signal

    import uvicorn

    from serving.server import create_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    workspace = open_workspace(args.config)
    http = workspace.server.http.model_copy(update={k: v for k, v in (("host", args.host), ("port", args.port))
                                                    if v is not None})
    workspace.server = workspace.server.model_copy(update={"http": http})
    local_ray = None
    if args.ray:
        from serving.backends.ray_process import start_ray
        from serving.backends.ray_replica import run_engines

        local_ray = start_ray()
    try:
        if args.ray:
            logging.getLogger(__name__).info("Ray Serve engines: %s",
                                             ", ".join(run_engines(workspace.server, workspace.root)) or "none")
        # Listens at once, /healthz 200 and /readyz 503 while the models load (a probe does not restart us).
        app = create_server(workspace, freeze_heap=True, listen_while_starting=True)
        server = uvicorn.Server(uvicorn.Config(app, host=http.host, port=http.port, log_level=args.log_level,
                                               access_log=False, timeout_graceful_shutdown=int(http.shutdown_grace_s)))
        state = app.state.inferline
        state.stop_serving = lambda: setattr(server, "should_exit", True)
        # uvicorn drains on SIGTERM, then re-raises the signal to the handler it
        # found at start; a no-op one here makes a drained shutdown exit 0.
        signal.signal(signal.SIGTERM, lambda *_: None)
        server.run()
        if state.start_error:
            return EXIT_FAILED
    finally:
        if local_ray is not None:
            from serving.backends.ray_process import stop_ray

            stop_ray(local_ray)  # a local Ray goes with this process; a cluster keeps its engines
    return EXIT_OK


def _deploy(args: argparse.Namespace) -> int:
    import os

    import yaml

    from serving.backends.ray_deploy import serve_config
    from serving.runtime.workspace import DEFAULT_CONFIG

    path = args.config or os.environ.get("INFERLINE_CONFIG") or (DEFAULT_CONFIG if Path(DEFAULT_CONFIG).exists()
                                                                  else None)
    if path is None:
        print("inferline: deploy needs a server config with backend: ray models (--config FILE; "
              "no ./inferline.yaml here)", file=sys.stderr)
        return EXIT_FAILED
    workspace = open_workspace(path)
    config = serve_config(workspace.server, Path(path))
    Path(args.output).write_text(yaml.safe_dump(config, sort_keys=False))
    engines = len(config["applications"][0]["deployments"]) - 1
    print(f"wrote {args.output}: application {config['applications'][0]['name']!r}, ingress and "
          f"{engines} engine deployment(s); deploy with: serve deploy {args.output}")
    return EXIT_OK


def _validate(args: argparse.Namespace) -> int:
    workspace = open_workspace(args.config)
    files = _expand(args.paths)
    if not files:
        print("inferline: no .yaml files found in " + " ".join(args.paths), file=sys.stderr)
        return EXIT_FAILED
    named: dict[Path, Path] = {}  # a file named twice (a folder and one of its files) is checked once
    for path in files:
        named.setdefault(path.resolve(), path)
    # What the files may reference (a score stage's judges, a pipeline step's callee): the pipelines served
    # beside them (the pipelines folder), and each other, even those that do not load.
    beside = declared_names([*files, *pipeline_files(workspace.pipelines_dir)]).values()
    checked = PipelineSet.load(workspace.load_pipeline, named.values(), beside)
    failed = 0
    for path in files:
        first = named[path.resolve()]
        loaded, issues = checked.loaded_from(first), checked.issues_of(first)
        if str(first) in checked.unreadable:
            print(f"{path}: {checked.unreadable[str(first)]}", file=sys.stderr)
        for issue in issues if str(first) not in checked.unreadable else ():
            print(issue, file=sys.stderr)
        if issues or loaded is None:
            failed += 1
        else:
            print(f"ok {path} ({loaded.spec.name}, {len(loaded.plans)} stages)")
    if failed:
        print(f"{failed} of {len(files)} file(s) invalid", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def _expand(paths: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        files += pipeline_files(path) if path.is_dir() else [path]
    return files


if __name__ == "__main__":
    sys.exit(main())
