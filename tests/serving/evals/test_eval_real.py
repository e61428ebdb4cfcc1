"""inferline eval with the real model, the real handbook index and MiniLM: each check type on the example
pipelines (rag, chat, extract) and the judge pipeline. Answers are whatever the 135M model says; what is
asserted is what the checks must get right about them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving.cli.eval import evaluate
from serving.evals.dataset import load_dataset
from serving.runtime.workspace import open_workspace

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[3]


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    monkeypatch.delenv("INFERLINE_CONFIG", raising=False)
    monkeypatch.setenv("INFERLINE_DATABASE", f"sqlite:///{tmp_path / 'eval.db'}")
    return open_workspace(str(ROOT / "inferline.yaml"))


def dataset(tmp_path, cases) -> object:
    path = tmp_path / "cases.jsonl"
    path.write_text("".join(json.dumps(case) + "\n" for case in cases))
    return load_dataset(path)


async def run(workspace, name, data, judges=()):
    loaded = workspace.load_pipeline(workspace.resolve(name))
    return await evaluate(workspace, loaded, [workspace.load_pipeline(workspace.resolve(j)) for j in judges], data, 3)


async def test_rag_cases_with_citation_similarity_and_judge(workspace, tmp_path):
    cases = [case for case in map(json.loads, (ROOT / "evals" / "handbook.jsonl").read_text().splitlines())
             if case["id"] in ("plus-price", "webhook-retries", "support-hours")]
    for case in cases:
        case["params"] = {"max_tokens": 48}  # short answers keep the test short
    summary, results, _ = await run(workspace, "rag", dataset(tmp_path, cases), ["judge"])
    assert [r["status"] for r in results] == ["ok"] * 3
    for result in results:
        checks = {c["name"]: c for c in result["checks"]}
        assert set(checks) == {"fact", "citation", "similarity", "judge"}
        assert not any(c.get("error") for c in checks.values()), checks
        # The retriever found the page each question is about: the citation check knows it.
        assert checks["citation"]["retrieved"] is True
        cited = checks["citation"]["cited"]
        assert checks["citation"]["passed"] == (bool(cited) and checks["citation"]["score"] == 1.0)
        assert -1.0 <= checks["similarity"]["score"] <= 1.0
        assert checks["similarity"]["passed"] == (checks["similarity"]["score"] >= 0.6)
        # The judge's answer is decoded under a choice of 1..5: always a grade.
        assert checks["judge"]["grade"] in (1.0, 2.0, 3.0, 4.0, 5.0) and checks["judge"]["judge_request_id"]
    assert summary["checks"]["judge"]["cases"] == 3 and summary["cost_usd"]["checks_total"] > 0
    assert summary["tokens"]["input_per_request"] > 300  # the retrieved pages are in the prompt


async def test_exact_and_json_schema_on_the_real_model(workspace, tmp_path):
    chat = dataset(tmp_path, [{"id": "france", "input": "What is the capital of France?", "checks": [
        {"type": "exact", "value": "The capital of France is Paris."},
        {"type": "normalized", "value": "the capital of france is paris"},
        {"type": "exact", "name": "wrong", "value": "Paris is the capital of Italy."}]}])
    _, (france,), _ = await run(workspace, "chat", chat)
    assert france["output"] == "The capital of France is Paris."
    assert [c["passed"] for c in france["checks"]] == [True, True, False]
    extract = dataset(tmp_path, [{"id": "mary", "input": "Mary Jones, 35, moved from Leeds to Bristol last May.",
                                  "checks": [{"type": "json_schema", "schema": {
                                      "type": "object", "required": ["name", "age", "city"]}}]}])
    _, (mary,), _ = await run(workspace, "extract", extract)
    assert mary["passed"] and json.loads(mary["output"])["age"] == 35
