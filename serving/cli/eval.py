"""``inferline eval``: run a dataset through a pipeline, check every answer, store and report the run.

    inferline eval rag --dataset evals/handbook.jsonl --report reports/rag       # a run, stored
    inferline eval rag --dataset evals/handbook.jsonl --baseline last           # ...against the last one
    inferline eval --list [rag]                                                 # stored runs, newest first
    inferline eval --show RUN [--baseline RUN] [--report DIR]                  # a stored run (against another)
    inferline eval retrieval handbook evals/handbook_retrieval.jsonl           # an index's recall, MRR, nDCG
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from datetime import datetime
from typing import Any

from pipeline.loader import LoadedPipeline
from serving.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Subcommands
from serving.evals.dataset import Dataset, load_dataset
from serving.evals.progress import Progress
from serving.evals.report import compare, summarize, write_reports
from serving.runtime.pipeline_set import PipelineSet
from serving.runtime.workspace import Workspace, open_workspace
from store.eval_runs import EvalRunStore, UnknownRun


def add_eval_parser(sub: Subcommands) -> None:
    parser = sub.add_parser(
        "eval", help="evaluate a pipeline on a dataset: pass rates, latency, tokens, cost; against a baseline",
        description="Run every case of a JSON Lines dataset through PIPELINE in-process (concurrently, the real "
                    "pipeline and models), check each answer (exact, normalized, contains, regex, json_schema, "
                    "similarity, citation, judge), store the run in the config's database and print its summary. "
                    "--report writes report.md and report.json; --baseline compares with a stored run.",
        epilog="Examples: inferline eval rag --dataset evals/handbook.jsonl --report reports/rag; "
               "inferline eval rag --dataset evals/handbook.jsonl --baseline last; inferline eval --list rag; "
               "inferline eval --show RUN --baseline OTHER --report reports/diff; "
               "inferline eval retrieval handbook evals/handbook_retrieval.jsonl (recall@k, MRR and nDCG@10 of an "
               "index per search mode: dense, keyword, hybrid)")
    parser.add_argument("pipeline", nargs="?", metavar="PIPELINE",
                        help="a pipeline file or name in the pipelines folder (with --list: only its runs); or "
                             "retrieval, followed by INDEX DATASET.jsonl")
    parser.add_argument("args", nargs="*", metavar="INDEX DATASET", help="after retrieval: the index and the "
                        'questions, one {"question", "relevant": [doc ids or paths]} per line')
    parser.add_argument("--k", type=int, default=5, help="retrieval: the k of recall@k (default 5)")
    parser.add_argument("--modes", default="dense,keyword,hybrid",
                        help="retrieval: the search modes measured (default dense,keyword,hybrid)")
    parser.add_argument("--json", action="store_true", help="retrieval: one JSON object instead of a table")
    parser.add_argument("--dataset", "-d", metavar="FILE.jsonl", help="the cases, one JSON object per line")
    parser.add_argument("--baseline", "-b", metavar="RUN",
                        help="a stored run to compare with: its id (or a unique prefix), or 'last' (the pipeline's "
                             "newest run before this one)")
    parser.add_argument("--concurrency", "-n", type=int, default=4, metavar="N",
                        help="cases in flight at once (default 4)")
    parser.add_argument("--report", "-r", metavar="DIR", help="write report.md and report.json into DIR")
    parser.add_argument("--min-pass-rate", type=float, metavar="R",
                        help="exit 1 if the fraction of cases passing every check is below R (for CI)")
    parser.add_argument("--no-store", action="store_true", help="do not store the run in the database")
    parser.add_argument("--list", action="store_true", help="list stored runs (of PIPELINE, if given)")
    parser.add_argument("--limit", type=int, default=20, help="--list: how many runs (default 20)")
    parser.add_argument("--show", metavar="RUN", help="report a stored run instead of running (with --baseline: "
                                                      "the comparison of two stored runs)")
    parser.add_argument("--config", "-c", metavar="FILE",
                        help="server config (default: $INFERLINE_CONFIG, else ./inferline.yaml if present)")
    parser.set_defaults(handler=_eval)


def _eval(args: argparse.Namespace) -> int:
    if args.pipeline == "retrieval":
        from serving.cli.eval_retrieval import run

        return run(args)
    if args.args:
        print(f"inferline eval: unexpected arguments {' '.join(args.args)} (only `eval retrieval` takes INDEX "
              "DATASET; a pipeline's dataset is --dataset FILE)", file=sys.stderr)
        return EXIT_USAGE
    workspace = open_workspace(args.config)
    if args.list:
        return _list(workspace, args)
    if args.show:
        return _show(workspace, args)
    if not args.pipeline or not args.dataset:
        print("inferline eval: give PIPELINE and --dataset FILE (or --list, or --show RUN)", file=sys.stderr)
        return EXIT_USAGE
    if args.concurrency < 1:
        print("inferline eval: --concurrency must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    dataset = load_dataset(args.dataset)  # bad lines are reported before any model loads
    loaded = workspace.load_pipeline(workspace.resolve(args.pipeline))
    judges = _judges(workspace, loaded, dataset)
    PipelineSet.of([loaded, *judges]).checked()
    store = _store(workspace)
    baseline_id = None
    try:
        baseline_id = store.resolve(args.baseline, loaded.spec.name) if args.baseline else None
    except UnknownRun as exc:
        print(f"inferline eval: {exc}", file=sys.stderr)
        return EXIT_FAILED
    summary, results, created_at = asyncio.run(evaluate(workspace, loaded, judges, dataset, args.concurrency))
    if not args.no_store:
        store.save(summary, results, baseline_id=baseline_id, created_at=created_at)
    diff = None
    if baseline_id is not None:
        base_summary, base_results = store.get(baseline_id)
        diff = compare(summary, results, base_summary, base_results)
    _print_summary(summary, diff)
    if args.report:
        paths = write_reports(args.report, summary, results, diff)
        print(f"reports: {paths[1]} {paths[0]}")
    if args.min_pass_rate is not None and summary["pass_rate"] < args.min_pass_rate:
        print(f"inferline eval: pass rate {summary['pass_rate']:.3f} is below --min-pass-rate {args.min_pass_rate}",
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


async def evaluate(workspace: Workspace, loaded: LoadedPipeline, judges: list[LoadedPipeline], dataset: Dataset,
                   concurrency: int, *, engines: Any = None
                   ) -> tuple[dict[str, Any], list[dict[str, Any]], datetime]:
    """Run *dataset* through *loaded* in-process; the run's summary, its cases (as dicts) and its start."""
    from serving.evals.harness import run_cases
    from serving.runtime.resources import Runtime, RuntimeOptions
    from store.db import utcnow

    created_at = utcnow()
    named = {j.spec.name for j in judges}
    judges = [*judges, *(j for j in _load_judges(workspace, loaded, set()) if j.spec.name not in named)]
    embed = await _embedder(dataset)
    started = time.monotonic()
    async with Runtime(workspace, [loaded, *judges], RuntimeOptions(engines=engines)) as runtime:
        progress = Progress(len(dataset.cases), f"eval {loaded.spec.name}")
        results = await run_cases(runtime.runner, runtime.pipelines[loaded.spec.name], dataset,
                                  concurrency=concurrency, calls=runtime.calls, embed=embed, progress=progress)
    rows = [r.to_dict() for r in results]
    summary = summarize(rows, slo=loaded.spec.slo, run_id=str(uuid.uuid4()), created_at=created_at.isoformat(),
                        pipeline=loaded.spec.name, pipeline_version=loaded.spec.version,
                        spec_sha256=loaded.sha256, dataset=dataset.file, dataset_sha256=dataset.sha256,
                        concurrency=concurrency, wall_s=round(time.monotonic() - started, 2))
    return summary, rows, created_at


async def _embedder(dataset: Dataset) -> Any:
    if not any(check.type == "similarity" for _, case in dataset.cases for check in case.checks):
        return None
    from store.embeddings import shared_embedder

    embedder = await asyncio.to_thread(shared_embedder)
    return embedder.encode


def _judges(workspace: Workspace, loaded: LoadedPipeline, dataset: Dataset) -> list[LoadedPipeline]:
    """The judge pipelines the dataset's checks and the pipeline's score stages name, loaded."""
    names = {check.pipeline for _, case in dataset.cases for check in case.checks if check.type == "judge"}
    return _load_judges(workspace, loaded, names)


def score_judges(workspace: Workspace, loaded: LoadedPipeline) -> list[LoadedPipeline]:
    """The judge pipelines *loaded*'s score stages name (for running it in-process), checked and loaded."""
    judges = _load_judges(workspace, loaded, set())
    PipelineSet.of([loaded, *judges]).checked()
    return judges


def _load_judges(workspace: Workspace, loaded: LoadedPipeline, names: set[str]) -> list[LoadedPipeline]:
    """The pipelines *loaded* calls (judges, sub-pipelines), those they call in turn, and *names*."""
    found: dict[str, LoadedPipeline] = {}
    wanted = sorted(names | {name for plan in loaded.plans for _, name in plan.cls.calls(plan.config)})
    while wanted:
        name = wanted.pop()
        if name == loaded.spec.name or name in found:
            continue
        found[name] = callee = workspace.load_pipeline(workspace.resolve(name))
        wanted += [call for plan in callee.plans for _, call in plan.cls.calls(plan.config)]
    return [found[name] for name in sorted(found)]


def _store(workspace: Workspace) -> EvalRunStore:
    from serving.runtime.database import open_engine

    return EvalRunStore(open_engine(workspace.database_url))


def _list(workspace: Workspace, args: argparse.Namespace) -> int:
    runs = _store(workspace).list_runs(args.pipeline, args.limit)
    if not runs:
        print("no stored eval runs" + (f" of pipeline {args.pipeline!r}" if args.pipeline else ""), file=sys.stderr)
        return EXIT_OK
    rows = [("run", "created (UTC)", "pipeline", "cases", "pass rate", "spec", "dataset")]
    rows += [(r["id"], r["created_at"].strftime("%Y-%m-%d %H:%M:%S"), r["pipeline"], str(r["num_cases"]),
              f"{r['pass_rate'] * 100:.1f}%", r["spec_sha256"][:12], r["dataset"]) for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return EXIT_OK


def _show(workspace: Workspace, args: argparse.Namespace) -> int:
    store = _store(workspace)
    try:
        run_id = store.resolve(args.show, args.pipeline)
        summary, results = store.get(run_id)
        diff = None
        if args.baseline:
            base_summary, base_results = store.get(store.resolve(args.baseline, summary["pipeline"]))
            diff = compare(summary, results, base_summary, base_results)
    except UnknownRun as exc:
        print(f"inferline eval: {exc}", file=sys.stderr)
        return EXIT_FAILED
    _print_summary(summary, diff)
    if args.report:
        paths = write_reports(args.report, summary, results, diff)
        print(f"reports: {paths[1]} {paths[0]}")
    return EXIT_OK


def _print_summary(summary: dict[str, Any], diff: dict[str, Any] | None) -> None:
    out = sys.stdout
    print(f"run {summary['run_id']}: {summary['pipeline']} on {summary['dataset']}: {summary['passed_cases']}/"
          f"{summary['num_cases']} cases passed ({summary['pass_rate'] * 100:.1f}%)", file=out)
    for name, entry in sorted(summary["checks"].items()):
        delta = diff["checks"].get(name, {}).get("delta") if diff else None
        shift = f" ({delta * 100:+.1f} pts)" if delta is not None else ""
        errors = f", {entry['errors']} errors" if entry["errors"] else ""
        print(f"  {name:<20} {entry['passed']:>4}/{entry['cases']:<4} {entry['pass_rate'] * 100:5.1f}%{shift}{errors}",
              file=out)
    lat = summary["latency_ms"]

    def p(name: str, q: str) -> str:
        value = lat[name][q]
        return "-" if value is None else f"{value:.0f}"

    cost = summary["cost_usd"]["per_request"]
    print(f"  latency ms p50/p95: ttft {p('ttft_ms', 'p50')}/{p('ttft_ms', 'p95')}, itl {p('itl_ms', 'p50')}/"
          f"{p('itl_ms', 'p95')}, e2e {p('e2e_ms', 'p50')}/{p('e2e_ms', 'p95')}; tokens per request "
          f"{summary['tokens']['input_per_request']} in, {summary['tokens']['output_per_request']} out; cost per "
          f"request {cost if cost is None else f'{cost:.8f}'} USD", file=out)
    if diff:
        counts, flips = diff["cases"], diff["checks_flipped"]
        more = f", {counts['new']} new, {counts['removed']} removed" if counts["new"] or counts["removed"] else ""
        print(f"  against {diff['baseline_id']}: pass rate {diff['pass_rate']['delta'] * 100:+.1f} pts; cases "
              f"{counts['fixed']} fixed, {counts['regressed']} regressed, {counts['same']} unchanged{more}; checks "
              f"{flips['fixed']} fail→pass, {flips['regressed']} pass→fail", file=out)
