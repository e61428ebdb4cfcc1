"""bench/retrieval.py runs end to end on tiny inputs and gives every figure its docstring names."""

from __future__ import annotations

import json

import pytest

from bench import retrieval


@pytest.mark.slow
def test_a_tiny_run_gives_every_figure(capsys):
    assert retrieval.main(["--quick", "--chunks", "2000", "--queries", "3", "--bm25-docs", "200", "--pdfs", "1"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("recall_at_10", "qps_vs_exact", "retrieve_ms_p50", "hybrid_ndcg10_vs_dense", "hybrid_recall5",
                 "hybrid_ms_vs_dense", "bm25_build_docs_per_s", "ingest_pages_per_s", "ingest_build_pages_per_s"):
        assert figures[name] > 0, name
    assert figures["labeled_questions"] >= 60 and figures["pdf_pages"] == 10
    assert 0 < figures["hybrid_recall5"] <= 1
