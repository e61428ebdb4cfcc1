"""``inferline index``: build, extend, inspect and query indexes (vectors and BM25, with metadata).

    inferline index build pipelines/data/handbook --name handbook [--chunk-tokens 200 --overlap 40]
    inferline index add pipelines/data/handbook --name handbook     # new or changed files embedded, gone ones removed
    inferline index remove handbook billing-and-plans               # a document out, by id or path
    inferline index info handbook
    inferline index search handbook "How much is the Plus plan?" [--top-k 4] [--mode hybrid] [--json]

Markdown, text, PDF, HTML and DOCX files are read; a file that cannot be read (a broken or encrypted PDF) is
skipped with a line that names it, and counted. The index lives in ``indexes.NAME.path`` of the server config
(default ``indexes/NAME`` next to it), with that entry's type (flat, ivf, hnsw), model, chunking and metadata
fields; the flags override chunking and type for a build. A running server picks up a new version within
``reload_every_s``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.spec import NAME_PATTERN
from serving.cli.common import EXIT_FAILED, EXIT_OK, Subcommands
from serving.runtime.workspace import Workspace, open_workspace

if TYPE_CHECKING:
    from store.vector_index import VectorStore



def add_index_parser(subparsers: Subcommands) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", metavar="FILE",
                        help="server config (default: $INFERLINE_CONFIG, else ./inferline.yaml if present)")
    index = subparsers.add_parser("index", help="build and query indexes for the retrieve stage",
                                  description="Indexes of chunked documents: embeddings (FAISS) and words (BM25).")
    actions = index.add_subparsers(dest="index_command", metavar="ACTION", required=True)

    build = actions.add_parser("build", parents=[common], help="index every document under DOCS, from scratch",
                               description="Read the Markdown, text, PDF, HTML and DOCX files under DOCS (with "
                                           "their front matter and metadata.json metadata), chunk them by tokens "
                                           "with overlap, embed them, index their words and write a new version "
                                           "of the index. Files that cannot be read are skipped and listed.")
    build.add_argument("docs", metavar="DOCS", type=Path, help="a folder (read recursively) or one file")
    build.add_argument("--name", required=True, type=index_name, help="the index name pipelines use (indexes.NAME)")
    build.add_argument("--chunk-tokens", type=int, metavar="N", help="tokens per chunk (default 200)")
    build.add_argument("--overlap", type=int, metavar="M", help="tokens shared by neighbouring chunks (default 40)")
    build.add_argument("--type", choices=("flat", "ivf", "hnsw"), help="index type (default: the config's, flat)")
    build.set_defaults(handler=_build)

    add = actions.add_parser("add", parents=[common], help="add new and changed documents to an index",
                             description="Embed only the files under DOCS that are new or whose content or "
                                         "metadata changed (by SHA-256); reuse every other chunk; remove the "
                                         "documents whose file is gone (unless --keep-missing).")
    add.add_argument("docs", metavar="DOCS", type=Path)
    add.add_argument("--name", required=True, type=index_name)
    add.add_argument("--keep-missing", action="store_true", help="keep the documents whose file is gone")
    add.set_defaults(handler=_add)

    remove = actions.add_parser("remove", parents=[common], help="remove documents from an index",
                                description="Write a new version of the index without the documents named "
                                            "(by id, the path without its suffix, or by path).")
    remove.add_argument("name", type=index_name)
    remove.add_argument("ids", metavar="ID", nargs="+")
    remove.set_defaults(handler=_remove)

    info = actions.add_parser("info", parents=[common], help="show an index's version, size and settings")
    info.add_argument("name", type=index_name)
    info.set_defaults(handler=_info)

    search = actions.add_parser("search", parents=[common], help="query an index from the command line")
    search.add_argument("name", type=index_name)
    search.add_argument("query")
    search.add_argument("--top-k", type=int, default=4, metavar="K")
    search.add_argument("--mode", choices=("dense", "keyword", "hybrid"),
                        help="default: hybrid where the index has a keyword side, else dense")
    search.add_argument("--json", action="store_true", help="one JSON object per hit")
    search.set_defaults(handler=_search)


def index_name(value: str) -> str:
    """An index name as inferline.yaml allows it: it names a folder under indexes/, so never a path."""
    if not re.fullmatch(NAME_PATTERN, value):
        raise argparse.ArgumentTypeError(f"invalid index name {value!r}: use lowercase letters, digits, '-' and "
                                         f"'_', starting with a letter")
    return value


def _build(args: argparse.Namespace) -> int:
    from serving.backends.indexes import index_folder, index_settings
    from store.vector_index import VectorStore

    workspace = open_workspace(args.config)
    settings = index_settings(workspace.server.indexes.get(args.name), chunk_tokens=args.chunk_tokens,
                              overlap=args.overlap, type=args.type)
    spec = workspace.server.indexes.get(args.name)
    started = time.perf_counter()
    try:
        store = VectorStore.build(index_folder(workspace.server, workspace.root, args.name), args.name, args.docs,
                                  settings, fields=spec.metadata if spec else {})
    except (FileNotFoundError, ValueError) as exc:
        print(f"inferline index build: {exc}", file=sys.stderr)
        return EXIT_FAILED
    _report_skipped(store.skipped)
    skipped = f", {len(store.skipped)} skipped" if store.skipped else ""
    print(f"index {args.name!r} version {store.version}: {len(store.manifest['documents'])} documents{skipped}, "
          f"{len(store.chunks)} chunks, {settings.type}, in {time.perf_counter() - started:.1f} s")
    _hint(workspace, args.name)
    return EXIT_OK


def _add(args: argparse.Namespace) -> int:
    store, workspace = _open(args)
    spec = workspace.server.indexes.get(args.name)
    try:
        new, changes = store.add(args.docs, keep_missing=args.keep_missing, fields=spec.metadata if spec else None)
    except (FileNotFoundError, ValueError) as exc:
        print(f"inferline index add: {exc}", file=sys.stderr)
        return EXIT_FAILED
    _report_skipped([tuple(line.split(": ", 1)) for line in changes["skipped"]])
    print(f"index {args.name!r} version {new.version}: {len(changes['added'])} added, "
          f"{len(changes['changed'])} changed, {len(changes['unchanged'])} unchanged, "
          f"{len(changes['removed'])} removed, {len(changes['skipped'])} skipped; {len(new.chunks)} chunks")
    return EXIT_OK


def _remove(args: argparse.Namespace) -> int:
    store, _ = _open(args)
    try:
        new = store.remove(args.ids)
    except KeyError as exc:
        print(f"inferline index remove: {exc.args[0]}", file=sys.stderr)
        return EXIT_FAILED
    before, after = len(store.manifest["documents"]), len(new.manifest["documents"])
    print(f"index {args.name!r} version {new.version}: {before - after} removed; {after} documents, "
          f"{len(new.chunks)} chunks")
    return EXIT_OK


def _report_skipped(skipped: list[tuple[str, ...]]) -> None:
    for path, *reason in skipped:
        print(f"skipped {path}: {reason[0] if reason else 'unreadable'}", file=sys.stderr)


def _info(args: argparse.Namespace) -> int:
    store, _ = _open(args)
    json.dump(store.info(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return EXIT_OK


def _search(args: argparse.Namespace) -> int:
    store, _ = _open(args)
    try:
        hits = store.retrieve(args.query, args.top_k, mode=args.mode).hits
    except ValueError as exc:
        print(f"inferline index search: {exc}", file=sys.stderr)
        return EXIT_FAILED
    for rank, hit in enumerate(hits, start=1):
        if args.json:
            print(json.dumps({"rank": rank, "id": hit.id, "score": round(hit.score, 4), "source": hit.source,
                              "title": hit.title, "page": hit.page, "text": hit.text}))
        else:
            page = f" p. {hit.page}" if hit.page else ""
            print(f"{rank}. {hit.score:.3f}  {hit.source}{page}  {hit.title}\n   {' '.join(hit.text.split())[:160]}")
    return EXIT_OK


def _open(args: argparse.Namespace) -> tuple[VectorStore, Workspace]:
    from serving.backends.indexes import index_folder
    from store.vector_index import VectorStore

    workspace = open_workspace(args.config)
    return VectorStore.open(index_folder(workspace.server, workspace.root, args.name)), workspace


def _hint(workspace: Workspace, name: str) -> None:
    if name not in workspace.server.indexes:
        print(f"note: pipelines can use it once inferline.yaml declares it: indexes: {{{name}: {{}}}}",
              file=sys.stderr)
