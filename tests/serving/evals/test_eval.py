"""inferline eval over fake engines: every check type through a real pipeline, storage, baselines, reports."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import SpecError
from serving.cli.eval import evaluate
from serving.cli.main import main
from serving.evals.dataset import load_dataset
from serving.evals.report import compare
from store.engine import make_engine
from store.eval_runs import EvalRunStore
from tests.serving.evals.workspaces import engines

CASES = [
    {"id": "exact", "input": "Capital of France?", "checks": [
        {"type": "exact", "value": "Paris is the capital of France [1]."},
        {"type": "exact", "name": "exact-wrong", "value": "Lyon"}]},
    {"id": "normalized", "input": "Capital?", "checks": [
        {"type": "normalized", "value": ["paris is  THE capital of france 1"]}]},
    {"id": "contains", "input": "Capital?", "checks": [
        {"type": "contains", "value": ["paris", "FRANCE"]},
        {"type": "contains", "name": "contains-any", "value": ["Lyon", "Paris"], "mode": "any"},
        {"type": "contains", "name": "contains-missing", "value": ["Paris", "Lyon"]}]},
    {"id": "regex", "input": "Capital?", "checks": [
        {"type": "regex", "pattern": r"\[\d\]"}, {"type": "regex", "name": "regex-full", "pattern": "Paris",
                                                  "full": True}]},
    {"id": "json", "input": "As JSON?", "checks": [{"type": "json_schema", "schema": {"type": "object"}}]},
    {"id": "citation", "input": "Capital?", "checks": [
        {"type": "citation", "page": "d1"}, {"type": "citation", "name": "citation-wrong", "page": "other"}]},
    {"id": "judge", "input": "Capital?", "reference": "Paris", "checks": [
        {"type": "judge", "pipeline": "grader", "min_score": 4},
        {"type": "judge", "name": "judge-strict", "pipeline": "grader", "min_score": 5}]},
]


def write_dataset(path, cases) -> str:
    path.write_text("".join(json.dumps(case) + "\n" for case in cases))
    return str(path)


async def run(workspace, dataset_path, fake=None, concurrency=3):
    dataset = load_dataset(dataset_path)
    loaded = workspace.load_pipeline(workspace.resolve("qa"))
    judges = [workspace.load_pipeline(workspace.resolve("grader"))]
    return await evaluate(workspace, loaded, judges, dataset, concurrency, engines=fake or engines())


async def test_every_check_type_through_the_pipeline(workspace, tmp_path):
    summary, results, _ = await run(workspace, write_dataset(tmp_path / "cases.jsonl", CASES))
    verdicts = {c["name"]: c["passed"] for r in results for c in r["checks"]}
    assert verdicts == {
        "exact": True, "exact-wrong": False, "normalized": True, "contains": True, "contains-any": True,
        "contains-missing": False, "regex": True, "regex-full": False, "json_schema": False, "citation": True,
        "citation-wrong": False, "judge": True, "judge-strict": False}
    citation = next(c for r in results for c in r["checks"] if c["name"] == "citation")
    assert citation["cited"] == [1] and citation["retrieved"] is True
    judge = next(c for r in results for c in r["checks"] if c["name"] == "judge")
    assert judge["grade"] == 4.0 and judge["score"] == 0.8 and judge["judge_request_id"]
    assert all(r["status"] == "ok" and r["output"] == "Paris is the capital of France [1]." for r in results)
    # A case passes when every one of its checks does: only "normalized" has no failing check.
    assert [r["case_id"] for r in results if r["passed"]] == ["normalized"]
    assert summary["num_cases"] == 7 and summary["passed_cases"] == 1 and summary["pass_rate"] == round(1 / 7, 4)
    assert summary["checks"]["contains-missing"] == {"type": "contains", "cases": 1, "passed": 0, "errors": 0,
                                                     "pass_rate": 0.0, "mean_score": 0.5}
    assert summary["tokens"]["output_per_request"] == len("Paris is the capital of France [1].")
    assert summary["cost_usd"]["per_request"] > 0 and summary["cost_usd"]["checks_total"] > 0
    assert summary["latency_ms"]["e2e_ms"]["count"] == 7 and summary["latency_ms"]["ttft_ms"]["p95"] is not None
    assert summary["slo"]["e2e_ms_p95"]["attainment"] == 1.0


BASELINE_CASES = [
    {"id": "paris", "input": "Capital of France?", "checks": [{"type": "contains", "value": "Paris"}]},
    {"id": "lyon", "input": "Third city?", "checks": [{"type": "contains", "value": "Lyon"}]},
    {"id": "cite", "input": "Capital?", "checks": [{"type": "citation", "page": "d1"}]},
]


async def test_a_change_compared_with_its_baseline(workspace, tmp_path, capsys):
    path = write_dataset(tmp_path / "cases.jsonl", BASELINE_CASES)
    store = EvalRunStore(make_engine(workspace.database_url))
    first, first_rows, at = await run(workspace, path, engines("Paris, then Lyon [1]."))
    store.save(first, first_rows, created_at=at)
    # The change: the answer no longer cites, and drops Lyon.
    second, second_rows, at2 = await run(workspace, path, engines("Paris."))
    baseline_id = store.resolve("last", "qa")
    assert baseline_id == first["run_id"]
    store.save(second, second_rows, baseline_id=baseline_id, created_at=at2)
    base_summary, base_rows = store.get(baseline_id)
    diff = compare(second, second_rows, base_summary, base_rows)
    assert diff["pass_rate"] == {"baseline": 1.0, "current": round(1 / 3, 4), "delta": round(1 / 3 - 1, 4)}
    assert diff["cases"] == {"fixed": 0, "regressed": 2, "same": 1, "new": 0, "removed": 0}
    assert diff["checks_flipped"] == {"fixed": 0, "regressed": 2}
    by_id = {c["id"]: c for c in diff["per_case"]}
    assert by_id["lyon"]["checks"]["contains"] == {"baseline": True, "current": False, "score_delta": -1.0}
    assert by_id["cite"]["change"] == "regressed" and by_id["paris"]["output_changed"] is True
    assert diff["checks"]["citation"]["delta"] == -1.0 and diff["spec_changed"] is False

    config = str(workspace.root / "inferline.yaml")
    assert main(["eval", "--list", "qa", "--config", config]) == 0
    listed = capsys.readouterr().out
    assert first["run_id"] in listed and second["run_id"] in listed and "33.3%" in listed
    report = tmp_path / "report"
    assert main(["eval", "--show", second["run_id"][:8], "--baseline", first["run_id"], "--report", str(report),
                 "--config", config]) == 0
    out = capsys.readouterr().out
    assert "1/3 cases passed" in out and "0 fixed, 2 regressed, 1 unchanged" in out
    body = json.loads((report / "report.json").read_text())
    assert body["baseline"]["baseline_id"] == first["run_id"] and len(body["cases"]) == 3
    text = (report / "report.md").read_text()
    assert "## Against baseline" in text and "- `lyon`: contains pass→fail" in text
    assert "Checks: 0 went from fail to pass, 2 from pass to fail." in text
    assert "| citation | citation | 0/1 | 0.0% |" in text


async def test_a_failed_request_fails_its_checks(workspace, tmp_path):
    path = write_dataset(tmp_path / "cases.jsonl", [
        {"id": "bad-param", "input": "hi", "params": {"speculative": False},
         "checks": [{"type": "regex", "pattern": "."}]},
        {"id": "json", "input": "as JSON", "checks": [{"type": "json_schema", "schema": {
            "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}]}])
    _, results, _ = await run(workspace, path, engines('{"city": "Paris"}'))
    failed, ok = results
    assert failed["status"] == "failed" and not failed["passed"]
    assert failed["checks"][0]["error"].startswith("the request failed")
    assert ok["passed"] and ok["checks"][0] == {"name": "json_schema", "type": "json_schema", "passed": True,
                                                "score": 1.0}


def test_bad_dataset_lines_are_located(tmp_path, capsys, workspace):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        '{"id": "ok", "input": "hi", "checks": [{"type": "exact", "value": "x"}]}',
        '{"id": "ok", "input": "again", "checks": [{"type": "exact", "value": "x"}]}',
        '{"input": "hi", "checks": [{"type": "exakt", "value": "x"}]}',
        '{"input": "hi", "checks": [{"type": "regex", "pattern": "("}]}',
        '{"input": "hi", "chekcs": []}',
        '{"input": "hi", "checks": [{"type": "contains"}]}',
        "# a comment, then a blank line", "",
        '{"input": "hi", "checks": [}',
    ]) + "\n")
    with pytest.raises(SpecError) as caught:
        load_dataset(path)
    lines = [str(issue) for issue in caught.value.issues]
    name = str(path)
    assert lines[0] == f"{name}:2:2: id: duplicate case id 'ok' (first used on line 1); ids must be unique"
    assert lines[1].startswith(f"{name}:3:") and "unknown check type 'exakt'; did you mean 'exact'?" in lines[1]
    assert lines[2].startswith(f"{name}:4:") and "checks[0].pattern: not a valid regular expression" in lines[2]
    assert any(line.startswith(f"{name}:5:") and "unknown key 'chekcs'; did you mean 'checks'?" in line
               for line in lines)
    assert any(line.startswith(f"{name}:6:") and "checks[0].value: missing required key 'value'" in line
               for line in lines)
    assert lines[-1].startswith(f"{name}:9:28: not valid JSON")
    config = str(workspace.root / "inferline.yaml")
    assert main(["eval", "qa", "--dataset", str(path), "--config", config]) == 1
    assert capsys.readouterr().err.splitlines()[0] == lines[0]


def test_a_score_stage_must_name_a_served_judge(workspace, tmp_path):
    from serving.runtime.pipeline_set import PipelineSet

    (workspace.root / "pipelines" / "scored.yaml").write_text(
        "name: scored\nstages:\n  - {id: prompt, type: prompt}\n  - {id: tok, type: tokenize}\n"
        "  - {id: gen, type: generate}\n  - {id: out, type: stream}\n  - id: score\n    type: score\n"
        "    with:\n      sample_rate: 1\n      checks:\n        - {type: judge, pipeline: gradr}\n")
    scored = workspace.load_pipeline(workspace.root / "pipelines" / "scored.yaml")
    with pytest.raises(SpecError) as caught:
        PipelineSet.of([scored, workspace.load_pipeline(workspace.root / "pipelines" / "grader.yaml")]).checked()
    assert str(caught.value).endswith("scored.yaml:12:35: stages[4].with.checks[0].pipeline: no pipeline 'gradr' is "
                                      "served beside it; did you mean 'grader'? (pipelines: grader, scored)")
