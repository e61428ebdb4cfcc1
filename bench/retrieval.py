"""Retrieval speed and recall: approximate indexes against exact search, and the retrieve stage end to end.

    .venv/bin/python bench/retrieval.py [--quick] [--chunks N] [--queries Q]

Data: N (100,000) synthetic 384-dimensional unit vectors, the shape of all-MiniLM-L6-v2 embeddings,
drawn around N/10 random "topics" (each vector = its topic + Gaussian noise, normalised), because
real embeddings cluster by topic. Ten chunks per topic means a query's top 10 spans several topics:
with fewer, larger topics the top 10 all sit in one and recall is trivially high. Uniform random
vectors are also measured and reported (``recall_at_10_uniform``): in 384 dimensions they have no
neighbourhood structure, so no approximate index finds their neighbours cheaply; they say nothing
about text and are shown for honesty.

exact   ``IndexFlatIP`` (our ``type: flat``), one query at a time, as the retrieve stage searches.
hnsw    our ``type: hnsw`` (M 32 and efConstruction 200, the defaults; efSearch 256, set in the config),
        built by ``make_faiss_index``.
ivf     our ``type: ivf`` (nlist 1024, nprobe 32, the defaults).
Figures: ``recall_at_10`` (of the HNSW index: the share of the exact top 10 it returns, target >= 0.95),
``qps_vs_exact`` (its single-query throughput over the exact index's, target >= 5), the same for IVF
(``ivf_*``), and ``retrieve_ms_p50``: the real ``retrieve`` stage through the runner (embedding the
question with the real model, then searching the 100,000-chunk HNSW index), median over Q (100) questions
(target <= 20 ms).

Hybrid search over the bundled handbook (pipelines/data/handbook, indexed afresh in a temporary folder), in the
same run as dense search alone:

``hybrid_ndcg10_vs_dense``  nDCG@10 of hybrid search (BM25 and embeddings, reciprocal rank fusion) over dense
                            alone, on the labeled set evals/handbook_retrieval.jsonl (target >= 1.10), with
                            ``hybrid_recall5``, ``dense_ndcg10``, ``keyword_ndcg10``, ``hybrid_ndcg10`` and
                            ``hybrid_mrr`` beside it (serving/evals/retrieval.py computes them, as
                            ``inferline eval retrieval`` does);
``hybrid_ms_vs_dense``      one query's p50 latency, hybrid (both sides and the fusion) over dense alone, the two
                            modes alternating query by query (target <= 1.3);
``bm25_build_docs_per_s``   building the keyword side (bm25s with stemming) over B (20,000) handbook chunks,
                            repeated;
``ingest_pages_per_s``      reading PDFs (pypdf text extraction, 40 files of 10 pages written by
                            scripts/make_handbook_pdf.py) into documents with their page offsets; and
                            ``ingest_build_pages_per_s``, the same PDFs through a whole ``index build``
                            (reading, chunking, embedding, both sides).

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import tempfile
import textwrap
import time
from dataclasses import asdict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faiss
import numpy as np

from pipeline.context import RequestContext
from pipeline.events import Done
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, Resources
from pipeline.registry import StageRegistry
from pipeline.runner import Pipeline, Runner
from serving.evals.retrieval import evaluate, load_cases
from stages import register_builtins
from store.documents import read_documents
from store.embeddings import shared_embedder
from store.keyword_index import KeywordIndex
from store.vector_index import Chunk, IndexSettings, VectorStore, make_faiss_index

ROOT = Path(__file__).resolve().parents[1]
HANDBOOK = ROOT / "pipelines" / "data" / "handbook"
LABELED = ROOT / "evals" / "handbook_retrieval.jsonl"

DIM, CHUNKS_PER_TOPIC, NOISE = 384, 10, 0.08
HNSW = IndexSettings(type="hnsw", m=32, ef_construction=200, ef_search=256)
IVF = IndexSettings(type="ivf", nlist=1024, nprobe=32)
QUESTIONS = ["How much does the Plus plan cost?", "How do I reset my password?", "Where is my data stored?",
             "How do I export a workspace?", "What are the support hours?", "How do webhooks retry?",
             "Can I use Lumen offline?", "How do I invite a teammate?", "What does the Business plan add?",
             "How do I turn on two-factor authentication?"]


def unit(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a / np.linalg.norm(a, axis=1, keepdims=True), dtype=np.float32)


def clustered(rng: np.random.Generator, n: int, centers: np.ndarray) -> np.ndarray:
    return unit(centers[rng.integers(0, len(centers), n)] + NOISE * rng.standard_normal((n, DIM)))


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth, strict=True)]))


def single_qps(index: faiss.Index, queries: np.ndarray, settings: IndexSettings) -> float:
    if isinstance(index, faiss.IndexHNSWFlat):
        index.hnsw.efSearch = settings.ef_search
    elif isinstance(index, faiss.IndexIVF):
        index.nprobe = settings.nprobe
    started = time.perf_counter()
    for row in queries:
        index.search(row.reshape(1, -1), 10)
    return len(queries) / (time.perf_counter() - started)


def measure(vectors: np.ndarray, queries: np.ndarray, settings: IndexSettings, exact: faiss.Index,
            exact_qps: float) -> dict[str, float]:
    started = time.perf_counter()
    index = make_faiss_index(vectors, settings)
    build_s = time.perf_counter() - started
    qps = single_qps(index, queries, settings)
    _, truth = exact.search(queries, 10)
    _, found = index.search(queries, 10)
    return {"recall_at_10": round(recall(found, truth), 4), "qps": round(qps, 1),
            "qps_vs_exact": round(qps / exact_qps, 2), "build_s": round(build_s, 1)}, index


async def retrieve_ms(store: VectorStore, num: int) -> dict[str, float]:
    registry = register_builtins(StageRegistry())
    yaml_text = "name: r\nstages:\n  - {id: context, type: retrieve, with: {index: synth, top_k: 4}}\n"
    loaded = load_pipeline_text(textwrap.dedent(yaml_text), "r.yaml", registry, Catalog(indexes=frozenset({"synth"})))
    pipeline = Pipeline(loaded, Resources(Catalog(indexes=frozenset({"synth"})), indexes={"synth": store}))
    runner, durations = Runner(), []
    for i in range(num + 5):
        ctx = RequestContext.from_text("r", QUESTIONS[i % len(QUESTIONS)] + f" ({i})")
        final = await runner.run(pipeline, ctx)
        if not isinstance(final, Done) or len(ctx.documents) != 4:
            raise SystemExit(f"retrieve failed: {final}")
        if i >= 5:
            durations.append(final.summary.stages[0].duration_s * 1e3)
    embedder = store.embedder
    started = time.perf_counter()
    for question in QUESTIONS * 3:
        embedder.encode([question])
    embed_ms = (time.perf_counter() - started) / (len(QUESTIONS) * 3) * 1e3
    return {"retrieve_ms_p50": round(statistics.median(durations), 2),
            "retrieve_ms_p95": round(sorted(durations)[int(len(durations) * 0.95) - 1], 2),
            "embed_ms_mean": round(embed_ms, 2)}


def hybrid_figures(root: Path, repeats: int, bm25_docs: int, pdfs: int) -> dict[str, float]:
    """The handbook figures: quality on the labeled set, latency against dense alone, BM25 build, PDF ingest."""
    embedder = shared_embedder()
    store = VectorStore.build(root / "handbook", "handbook", HANDBOOK, IndexSettings(), embedder)
    cases = load_cases(LABELED, store.manifest["documents"])
    quality = evaluate(store, cases, ["dense", "keyword", "hybrid"], k=5)
    dense_ms: list[float] = []
    hybrid_ms: list[float] = []
    for case in [c for _ in range(repeats) for c in cases]:
        for mode, durations in (("dense", dense_ms), ("hybrid", hybrid_ms)):
            started = time.perf_counter()
            store.retrieve(case.question, 4, mode=mode)
            durations.append((time.perf_counter() - started) * 1e3)
    texts = [c.text for c in store.chunks]
    corpus = (texts * (bm25_docs // len(texts) + 1))[:bm25_docs]
    started = time.perf_counter()
    KeywordIndex.build(corpus)
    bm25_s = time.perf_counter() - started
    pages = write_pdfs(root / "pdfs", pdfs)
    started = time.perf_counter()
    scan = read_documents(root / "pdfs")
    read_s = time.perf_counter() - started
    if scan.skipped or sum(len(d.pages) for d in scan.documents) != pages:
        raise SystemExit(f"PDF ingest lost pages: {scan.skipped}")
    started = time.perf_counter()
    VectorStore.build(root / "pdf-index", "pdfs", root / "pdfs", IndexSettings(), embedder)
    build_s = time.perf_counter() - started
    dense_p50, hybrid_p50 = statistics.median(dense_ms), statistics.median(hybrid_ms)
    print(f"handbook ({len(cases)} questions): nDCG@10 dense {quality['dense']['ndcg@10']}, keyword "
          f"{quality['keyword']['ndcg@10']}, hybrid {quality['hybrid']['ndcg@10']}; p50 dense {dense_p50:.2f} ms, "
          f"hybrid {hybrid_p50:.2f} ms", file=sys.stderr)
    return {"hybrid_ndcg10_vs_dense": round(quality["hybrid"]["ndcg@10"] / quality["dense"]["ndcg@10"], 3),
            "hybrid_recall5": quality["hybrid"]["recall@5"], "hybrid_ndcg10": quality["hybrid"]["ndcg@10"],
            "hybrid_mrr": quality["hybrid"]["mrr"], "dense_ndcg10": quality["dense"]["ndcg@10"],
            "dense_recall5": quality["dense"]["recall@5"], "keyword_ndcg10": quality["keyword"]["ndcg@10"],
            "labeled_questions": len(cases), "dense_ms_p50": round(dense_p50, 2),
            "hybrid_ms_p50": round(hybrid_p50, 2), "hybrid_ms_vs_dense": round(hybrid_p50 / dense_p50, 3),
            "bm25_build_docs_per_s": round(bm25_docs / bm25_s, 1), "pdf_pages": pages,
            "ingest_pages_per_s": round(pages / read_s, 1), "ingest_build_pages_per_s": round(pages / build_s, 1)}


def write_pdfs(folder: Path, num: int, pages_each: int = 10) -> int:
    """*num* PDFs of *pages_each* pages of handbook text (each page a different page's text); the page count."""
    spec = importlib.util.spec_from_file_location("make_handbook_pdf", ROOT / "scripts" / "make_handbook_pdf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    sources = [p.read_text(encoding="utf-8") for p in sorted(HANDBOOK.glob("*.md"))]
    folder.mkdir(parents=True)
    for n in range(num):
        pages = [sources[(n * pages_each + i) % len(sources)] for i in range(pages_each)]
        module.write_pdf(folder / f"doc-{n:03d}.pdf", pages, f"Document {n}")
    return num * pages_each


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20,000 chunks, fewer queries (a smoke run)")
    parser.add_argument("--chunks", type=int, help="synthetic vectors (default 100,000; --quick 20,000)")
    parser.add_argument("--queries", type=int, help="retrieve-stage questions (default 100; --quick 30)")
    parser.add_argument("--repeats", type=int, help="passes over the labeled set for latency (default 5; --quick 1)")
    parser.add_argument("--bm25-docs", type=int, help="chunks the BM25 build indexes (default 20,000; --quick 2,000)")
    parser.add_argument("--pdfs", type=int, help="10-page PDFs ingested (default 40; --quick 4)")
    args = parser.parse_args(argv)
    quick = {"chunks": 20_000, "queries": 30, "repeats": 1, "bm25_docs": 2_000, "pdfs": 4}
    full = {"chunks": 100_000, "queries": 100, "repeats": 5, "bm25_docs": 20_000, "pdfs": 40}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    faiss.omp_set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(0)
    centers = unit(rng.standard_normal((max(1, args.chunks // CHUNKS_PER_TOPIC), DIM)))
    vectors, queries = clustered(rng, args.chunks, centers), clustered(rng, 200, centers)
    exact = make_faiss_index(vectors, IndexSettings(type="flat"))
    exact_qps = single_qps(exact, queries, IndexSettings(type="flat"))
    figures: dict[str, float] = {"chunks": args.chunks, "exact_qps": round(exact_qps, 1)}
    hnsw, hnsw_index = measure(vectors, queries, HNSW, exact, exact_qps)
    figures |= hnsw
    ivf, _ = measure(vectors, queries, IVF, exact, exact_qps)
    figures |= {f"ivf_{k}": v for k, v in ivf.items()}
    uniform = unit(rng.standard_normal((args.chunks, DIM)))
    uniform_queries = unit(rng.standard_normal((200, DIM)))
    uniform_exact = make_faiss_index(uniform, IndexSettings(type="flat"))
    figures["recall_at_10_uniform"] = measure(uniform, uniform_queries, HNSW, uniform_exact, exact_qps)[0][
        "recall_at_10"]
    print(f"hnsw: recall@10 {figures['recall_at_10']}, {figures['qps_vs_exact']}x exact", file=sys.stderr)
    chunks = [Chunk(i, f"doc{i // 8}", f"doc{i // 8}.md", f"Doc {i // 8}", 0, 10, 0, 2, f"chunk {i}")
              for i in range(args.chunks)]
    manifest = {"name": "synth", "version": "bench", "settings": asdict(HNSW), "documents": {}}
    store = VectorStore(Path("."), manifest, chunks, vectors, hnsw_index, shared_embedder())
    figures |= asyncio.run(retrieve_ms(store, args.queries))
    with tempfile.TemporaryDirectory() as tmp:
        figures |= hybrid_figures(Path(tmp), args.repeats, args.bm25_docs, args.pdfs)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
