"""``inferline eval retrieval INDEX DATASET.jsonl``: recall@k, MRR and nDCG@10 of an index, per search mode.

    inferline eval retrieval handbook evals/handbook_retrieval.jsonl [--k 5] [--modes dense,hybrid] [--json]

Searches the index's current version in-process (no server); see :mod:`serving.evals.retrieval` for the
dataset and the figures. Prints a Markdown table (or, with ``--json``, one JSON object).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from serving.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from serving.evals.retrieval import DatasetError, evaluate, load_cases, table
from serving.runtime.workspace import open_workspace

MODES = ("dense", "keyword", "hybrid")


def run(args: argparse.Namespace) -> int:
    """The ``retrieval`` action of ``inferline eval`` (its positional arguments after it: INDEX DATASET)."""
    from serving.backends.indexes import index_folder
    from store.vector_index import VectorStore

    if len(args.args) != 2:
        print("inferline eval retrieval: give INDEX and DATASET.jsonl", file=sys.stderr)
        return EXIT_USAGE
    name, dataset = args.args
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes or args.k < 1:
        print(f"inferline eval retrieval: --modes takes {', '.join(MODES)} (comma-separated) and --k at least 1",
              file=sys.stderr)
        return EXIT_USAGE
    workspace = open_workspace(args.config)
    try:
        index = VectorStore.open(index_folder(workspace.server, workspace.root, name))
        cases = load_cases(Path(dataset), index.manifest["documents"])
        if index.keywords is None and modes != ["dense"]:
            raise ValueError(f"index {name!r} has no keyword side (built before indexes had one): rebuild it, or "
                             "pass --modes dense")
        results = evaluate(index, cases, modes, args.k)
    except (FileNotFoundError, DatasetError, ValueError) as exc:
        print(f"inferline eval retrieval: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps({"index": name, "version": index.version, "questions": len(cases), "k": args.k,
                          "modes": results}))
    else:
        print(f"index {name!r} version {index.version}, {len(cases)} questions from {dataset}\n")
        print(table(results, len(cases)))
    return EXIT_OK
