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
(target <= 20 ms). The last line is one JSON object with every figure.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import asyncio
import json
import os
import statistics
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
from stages import register_builtins
from store.embeddings import shared_embedder
from store.vector_index import Chunk, IndexSettings, VectorStore, make_faiss_index

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20,000 chunks, fewer queries (a smoke run)")
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=100)
    args = parser.parse_args(argv)
    if args.quick:
        args.chunks, args.queries = 20_000, 30
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
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
