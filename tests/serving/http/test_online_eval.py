"""Online sampling through the app: a score stage's checks and its judge, in metrics and the audit record."""

from __future__ import annotations

import textwrap

from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines

SERVER = """
models:
  smol: {{source: models/none, price: {{input_per_1k: 1.0}}}}
  grader: {{source: models/none, price: {{input_per_1k: 0.5}}}}
database: sqlite:///{db}
pipelines: pipelines/
auth: {{enabled: false}}
"""

EXTRACT = """
name: extract
stages:
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 64, temperature: 0}}
  - {id: out, type: stream}
  - id: score
    type: score
    with:
      sample_rate: 1
      checks:
        - {name: valid, type: json_schema, schema: {type: object, required: [city]}}
        - {name: graded, type: judge, pipeline: grader, min_score: 4}
  - {id: log, type: audit, always: true}
"""

GRADER = """
name: grader
stages:
  - {id: prompt, type: prompt, with: {user: "Q: {{ tags.question }} A: {{ input }}"}}
  - {id: tok, type: tokenize, with: {model: grader}}
  - {id: gen, type: generate, with: {max_tokens: 2, temperature: 0}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true}
"""


def test_sampled_requests_are_scored_audited_and_counted(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "extract.yaml").write_text(textwrap.dedent(EXTRACT))
    (tmp_path / "pipelines" / "grader.yaml").write_text(textwrap.dedent(GRADER))
    config = tmp_path / "inferline.yaml"
    config.write_text(SERVER.format(db=tmp_path / "server.db"))
    engines = FakeEngines(smol=FakeEngine('{"city": "Leeds"}'), grader=FakeEngine("5"))
    with TestClient(create_server(open_workspace(str(config)), engines=engines)) as client:
        answer = client.post("/pipelines/extract", json={"input": "Mary lives in Leeds."}).json()
        assert answer["output"] == '{"city": "Leeds"}'
        score = next(s for s in answer["stages"] if s["id"] == "score")
        assert score["status"] == "ok" and score["cost_usd"] > 0  # the judge's request, on this stage's bill

        records = client.get("/audit/records", params={"pipeline": "extract"}).json()["records"]
        detail = client.get(f"/audit/records/{records[0]['id']}").json()
        decision = next(s["decision"] for s in detail["stages"] if s["stage_id"] == "score")
        valid, graded = decision["checks"]
        assert decision["sampled"] is True and valid == {"name": "valid", "type": "json_schema", "passed": True,
                                                         "score": 1.0}
        assert graded["passed"] is True and graded["grade"] == 5.0
        # The judge's own request is audited too, under the id this record names.
        judged = client.get("/audit/records", params={"pipeline": "grader"}).json()["records"]
        assert [r["request_id"] for r in judged] == [graded["judge_request_id"]]
        assert client.get("/audit/verify").json()["ok"] is True

        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        checks = {(s.labels["check"], s.labels["result"]): s.value
                  for s in families["inferline_online_eval_checks"].samples if s.name.endswith("_total")}
        assert checks == {("valid", "pass"): 1.0, ("graded", "pass"): 1.0}
        scores = {s.labels["check"]: s.value for s in families["inferline_online_eval_score"].samples
                  if s.name.endswith("_sum")}
        assert scores == {"valid": 1.0, "graded": 1.0}
        requests = {(s.labels["pipeline"], s.labels["status"]): s.value
                    for s in families["inferline_pipeline_requests"].samples if s.name.endswith("_total")}
        assert requests == {("extract", "ok"): 1.0, ("grader", "ok"): 1.0}
