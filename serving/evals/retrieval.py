"""Retrieval quality of an index: ``inferline eval retrieval INDEX DATASET.jsonl``.

A dataset line is ``{"question": "...", "relevant": ["billing-and-plans", "refunds-and-cancellation.md"]}``:
the documents (ids, or paths as the index lists them) that answer the question. Each question is searched in
each mode; the chunks found become a ranking of documents (a document counts once, at its best chunk), and
the ranking is scored with binary relevance:

- ``recall@k``: the share of a question's relevant documents in its first k;
- ``MRR``: the mean over questions of 1 / the rank of the first relevant document (0 when none is in the
  first ``depth``);
- ``nDCG@10``: discounted cumulative gain of the first 10 over the best possible order.

The figures are means over questions, as BEIR and MTEB report them; ``ms_p50`` is one search's median latency.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Chunks searched per question: enough for ten distinct documents with several chunks each.
CHUNK_DEPTH = 50


@dataclass(frozen=True, slots=True)
class Case:
    question: str
    #: Document ids (paths without their suffix).
    relevant: frozenset[str]
    line: int


class DatasetError(ValueError):
    """A dataset line that is not a question with its relevant documents: the file, line and why."""


def load_cases(path: Path, documents: dict[str, dict[str, Any]]) -> list[Case]:
    """The questions of *path*, their relevant documents checked against the index's *documents* (its manifest's:
    id -> entry with ``path``); raises :class:`DatasetError` at the first bad line."""
    by_path = {entry["path"]: doc_id for doc_id, entry in documents.items()}
    cases = []
    for number, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(raw)
        except ValueError as exc:
            raise DatasetError(f"{where}: not JSON ({exc})") from None
        if not isinstance(item, dict) or not isinstance(item.get("question"), str) or not item["question"].strip():
            raise DatasetError(f'{where}: expected {{"question": "...", "relevant": ["doc id or path", ...]}}')
        relevant = item.get("relevant")
        if not isinstance(relevant, list) or not relevant or not all(isinstance(r, str) for r in relevant):
            raise DatasetError(f"{where}: relevant must be a non-empty list of document ids or paths")
        ids = set()
        for name in relevant:
            doc_id = name if name in documents else by_path.get(name)
            if doc_id is None:
                raise DatasetError(f"{where}: {name!r} is not a document of the index (ids are paths without "
                                   "their suffix, as `inferline index info` lists them)")
            ids.add(doc_id)
        cases.append(Case(item["question"], frozenset(ids), number))
    if not cases:
        raise DatasetError(f"{path}: no questions")
    return cases


def documents_ranked(doc_ids: Iterable[str]) -> list[str]:
    """Chunk hits' documents in order, each once (at its best chunk)."""
    return list(dict.fromkeys(doc_ids))


def recall_at(ranked: Sequence[str], relevant: frozenset[str], k: int) -> float:
    return len(relevant.intersection(ranked[:k])) / len(relevant)


def reciprocal_rank(ranked: Sequence[str], relevant: frozenset[str]) -> float:
    return next((1 / rank for rank, doc_id in enumerate(ranked, start=1) if doc_id in relevant), 0.0)


def ndcg_at(ranked: Sequence[str], relevant: frozenset[str], k: int = 10) -> float:
    gain = sum(1 / math.log2(rank + 1) for rank, doc_id in enumerate(ranked[:k], start=1) if doc_id in relevant)
    ideal = sum(1 / math.log2(rank + 1) for rank in range(1, min(len(relevant), k) + 1))
    return gain / ideal


def evaluate(index: Any, cases: Sequence[Case], modes: Sequence[str], k: int = 5) -> dict[str, dict[str, float]]:
    """Per mode: ``recall@k``, ``mrr``, ``ndcg@10`` (means over *cases*) and ``ms_p50``, searching *index* (a
    :class:`store.vector_index.VectorStore`). The modes take turns question by question, after one search that
    loads the embedding model, so that their latencies are measured under the same conditions."""
    index.retrieve(cases[0].question, 1, mode=modes[0])
    scores: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in modes}
    durations: dict[str, list[float]] = {mode: [] for mode in modes}
    for case in cases:
        for mode in modes:
            started = time.perf_counter()
            hits = index.retrieve(case.question, CHUNK_DEPTH, mode=mode).hits
            durations[mode].append((time.perf_counter() - started) * 1e3)
            ranked = documents_ranked(h.doc_id for h in hits)
            scores[mode].append((recall_at(ranked, case.relevant, k), reciprocal_rank(ranked, case.relevant),
                                 ndcg_at(ranked, case.relevant)))
    results = {}
    for mode in modes:
        recall, mrr, ndcg = (statistics.fmean(column) for column in zip(*scores[mode], strict=True))
        results[mode] = {f"recall@{k}": round(recall, 4), "mrr": round(mrr, 4), "ndcg@10": round(ndcg, 4),
                         "ms_p50": round(statistics.median(durations[mode]), 2)}
    return results


def table(results: dict[str, dict[str, float]], num_cases: int) -> str:
    """*results* as a Markdown table, one row per mode."""
    names = list(next(iter(results.values())))
    lines = [f"| mode ({num_cases} questions) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {mode} | " + " | ".join(f"{row[n]:.3f}" if n != "ms_p50" else f"{row[n]:.1f}" for n in names) + " |"
              for mode, row in results.items()]
    return "\n".join(lines)


__all__ = ["CHUNK_DEPTH", "Case", "DatasetError", "documents_ranked", "evaluate", "load_cases", "ndcg_at",
           "recall_at", "reciprocal_rank", "table"]
