"""``inferline eval retrieval``: the metrics on fixed rankings, the dataset's checks, the command, and the shipped
labeled set over the handbook."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from serving.cli.main import main
from serving.evals.retrieval import DatasetError, documents_ranked, load_cases, ndcg_at, recall_at, reciprocal_rank

ROOT = Path(__file__).resolve().parents[3]
DOCUMENTS = {"billing": {"path": "billing.md"}, "refunds": {"path": "refunds.md"}, "sync": {"path": "sync.md"}}


def test_the_metrics_on_a_fixed_ranking():
    ranked = documents_ranked(["sync", "sync", "billing", "refunds", "billing"])
    assert ranked == ["sync", "billing", "refunds"]
    relevant = frozenset({"billing", "refunds"})
    assert recall_at(ranked, relevant, 1) == 0 and recall_at(ranked, relevant, 2) == 0.5
    assert recall_at(ranked, relevant, 5) == 1
    assert reciprocal_rank(ranked, relevant) == 0.5 and reciprocal_rank(["sync"], relevant) == 0
    ideal = 1 + 1 / math.log2(3)
    assert ndcg_at(ranked, relevant) == pytest.approx((1 / math.log2(3) + 1 / math.log2(4)) / ideal)
    assert ndcg_at(["billing", "refunds"], relevant) == pytest.approx(1.0)


@pytest.mark.parametrize(("line", "message"), [
    ('{"question": "q"}', "relevant must be a non-empty list"),
    ('{"question": "q", "relevant": ["nope"]}', "'nope' is not a document of the index"),
    ('{"relevant": ["billing"]}', 'expected {"question"'),
    ("not json", "not JSON"),
])
def test_a_bad_dataset_line_is_named(tmp_path, line, message):
    path = tmp_path / "set.jsonl"
    path.write_text('{"question": "fine", "relevant": ["billing.md", "refunds"]}\n' + line + "\n")
    with pytest.raises(DatasetError, match=f"set.jsonl:2: .*{message}" if "JSON" not in message else "set.jsonl:2"):
        load_cases(path, DOCUMENTS)


def test_relevant_documents_are_ids_or_paths(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text('{"question": "fine", "relevant": ["billing.md", "refunds"]}\n\n')
    (case,) = load_cases(path, DOCUMENTS)
    assert case.relevant == {"billing", "refunds"} and case.line == 1


def test_the_shipped_set_is_large_and_names_only_handbook_documents():
    handbook = ROOT / "pipelines" / "data" / "handbook"
    documents = {p.relative_to(handbook).with_suffix("").as_posix(): {"path": p.relative_to(handbook).as_posix()}
                 for p in handbook.iterdir() if p.suffix in (".md", ".pdf", ".html")}
    cases = load_cases(ROOT / "evals" / "handbook_retrieval.jsonl", documents)
    assert len(cases) >= 60
    assert sum(len(c.relevant) > 1 for c in cases) >= 8  # questions two pages answer
    assert {"admin-guide", "appearance-and-accessibility"} <= {d for c in cases for d in c.relevant}
    assert len({c.question for c in cases}) == len(cases)


def test_the_command_refuses_a_wrong_call(capsys):
    assert main(["eval", "retrieval", "handbook"]) == 2
    assert "give INDEX and DATASET.jsonl" in capsys.readouterr().err
    assert main(["eval", "retrieval", "handbook", "x.jsonl", "--modes", "dense,fuzzy"]) == 2
    assert main(["eval", "rag", "extra"]) == 2
    assert "unexpected arguments extra" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_prints_each_modes_figures(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "billing.md").write_text("# Billing\n\nThe Plus plan costs eight dollars per user per month.")
    (docs / "refunds.md").write_text("# Refunds\n\nYearly plans are refunded within 21 days of renewal.")
    (docs / "sync.md").write_text("# Sync\n\nThe desktop app keeps the last 500 notes offline.")
    (tmp_path / "inferline.yaml").write_text("indexes:\n  kb: {}\n")
    (tmp_path / "set.jsonl").write_text(
        '{"question": "What does Plus cost?", "relevant": ["billing"]}\n'
        '{"question": "Can I get my money back for a yearly plan?", "relevant": ["refunds.md"]}\n')
    config = str(tmp_path / "inferline.yaml")
    assert main(["index", "build", str(docs), "--name", "kb", "--config", config]) == 0
    capsys.readouterr()
    assert main(["eval", "retrieval", "kb", str(tmp_path / "set.jsonl"), "--config", config, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["questions"] == 2 and set(report["modes"]) == {"dense", "keyword", "hybrid"}
    assert set(report["modes"]["hybrid"]) == {"recall@5", "mrr", "ndcg@10", "ms_p50"}
    assert report["modes"]["dense"]["recall@5"] == 1.0
    assert main(["eval", "retrieval", "kb", str(tmp_path / "set.jsonl"), "--config", config, "--k", "1",
                 "--modes", "dense,hybrid"]) == 0
    out = capsys.readouterr().out
    assert "| mode (2 questions) | recall@1 | mrr | ndcg@10 | ms_p50 |" in out and "| hybrid |" in out
