"""A workflow in the console (issue 60, item 7): its page draws its graph, a record's page its steps' waterfall."""

from __future__ import annotations

import re

import pytest
from litestar.testing import TestClient

from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import write_workspace

FLOW = """
name: flow
access: {roles: [caller]}
stages:
  - {id: guard, type: policy}
  - {id: classify, type: llm, with: {system: "Classify.", temperature: 0}}
  - {id: context, type: llm, needs: [guard], with: {system: "Gather.", temperature: 0}}
  - {id: answer, type: llm, needs: [classify, context], stream: true, with: {system: "Answer.", temperature: 0}}
  - {id: log, type: audit, always: true, with: {content: hash}}
"""
STEPS = ("guard", "classify", "context", "answer", "log")


@pytest.fixture
def flow_client(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    (tmp_path / "pipelines" / "flow.yaml").write_text(FLOW)
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Fine.")))
    with TestClient(app) as client:
        yield client


def test_the_pipeline_page_draws_its_graph_as_svg(flow_client):
    page = flow_client.get("/ui/pipelines/flow")
    assert page.status_code == 200, page.text
    svg = page.text.split('<svg class="graph"')[1].split("</svg>")[0]
    for step in STEPS:
        assert f'data-step="{step}"' in svg and f">{step}</text>" in svg
    arrows = set(re.findall(r'data-from="([^"]+)" data-to="([^"]+)"', svg))
    assert arrows == {("guard", "classify"), ("guard", "context"), ("classify", "answer"), ("context", "answer"),
                      ("answer", "log")}
    places = dict(re.findall(r'data-step="([^"]+)" transform="translate\(\d+ (\d+)\)"', svg))
    assert places["classify"] == places["context"] != places["guard"]  # side by side: they may run together
    assert "http" not in svg and "<script" not in page.text.split("<main")[1].split("</main>")[0]
    chain = flow_client.get("/ui/pipelines/chat").text  # a chain is a graph too
    assert '<svg class="graph"' in chain and 'data-step="gen"' in chain


def test_the_record_page_has_a_bar_per_step_at_its_start(flow_client):
    answer = flow_client.post("/pipelines/flow", json={"input": "hello"})
    assert answer.status_code == 200, answer.text
    (listed,) = flow_client.get("/audit/records", params={"pipeline": "flow"}).json()["records"]
    record = flow_client.get(f"/audit/records/{listed['id']}").json()
    page = flow_client.get(f"/ui/audit/records/{listed['id']}").text
    table = page.split('id="record-waterfall"')[1].split("</table>")[0]
    rows = table.split('<tr class="wf-row"')[1:]
    assert [re.search(r'data-stage="([^"]+)"', row).group(1) for row in rows] == \
        [s["stage_id"] for s in record["stages"]] and {s["stage_id"] for s in record["stages"]} == set(STEPS) - {"log"}
    for row, stage in zip(rows, record["stages"], strict=True):
        assert 'class="span status-ok"' in row  # a bar, not a skip tick
        assert f">{stage['step']['started_ms']:.1f} ms</td>" in row
    assert "keeps each stage's duration, not its start" not in page  # the record has each step's start
