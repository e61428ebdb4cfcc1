"""A workflow over the HTTP routes (issue 60): its SSE stage events carry each step's attempt and skip reason, and
the routes that ask a pipeline about its answer (count_tokens) read a workflow's answering ``llm`` step."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from pipeline.events import StageFinished, StageStarted
from serving.http.pipeline_routes import stage_event
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.http.test_app import sse_events
from tests.serving.workspaces import write_workspace

FLOW = """
name: flow
access: {roles: [caller]}
stages:
  - id: classify
    type: llm
    retry: {attempts: 2, on: [invalid_output]}
    with:
      system: "Classify."
      temperature: 0
      output: {json_schema: {type: object, properties: {intent: {enum: [refund, tech]}}, required: [intent]}}
  - id: refund
    type: llm
    when: "steps.classify.output.intent == 'refund'"
    with: {system: "Refunds.", temperature: 0}
  - id: answer
    type: llm
    needs: [classify]
    stream: true
    with: {system: "You are tech support; answer in two sentences.", user: "{{ input }}", temperature: 0}
"""

OUTER = """
name: outer
access: {roles: [caller]}
stages:
  - {id: call, type: pipeline, with: {pipeline: flow, input: "{{ input }}"}}
"""


class FirstAnswerInvalid(FakeEngine):
    """Answers "not json" to its first call (the classify step's retry runs it again), then the intent, then the
    answer."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        self.calls += 1
        self.reply = {1: b"not json", 2: b'{"intent": "tech"}'}.get(self.calls, b"Restart the router.")
        return await super().submit(prompt_ids, sampling, cache_salt, hints=hints)


@pytest.fixture
def flow_client(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    (tmp_path / "pipelines" / "flow.yaml").write_text(FLOW)
    (tmp_path / "pipelines" / "outer.yaml").write_text(OUTER)
    with TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=FirstAnswerInvalid()))) \
            as client:
        yield client


def test_stage_events_carry_each_attempt_and_skip_reason(flow_client):
    response = flow_client.post("/pipelines/flow", json={"input": "my router is down", "stream": True})
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    stages = [data for kind, data in events if kind == "stage"]
    assert [(s["id"], s["status"], s["attempt"]) for s in stages] == [
        ("classify", "started", 1), ("classify", "failed", 1), ("classify", "started", 2), ("classify", "ok", 2),
        ("refund", "skipped", 1), ("answer", "started", 1), ("answer", "ok", 1)]
    failed, skipped = stages[1], stages[4]
    assert failed["retrying"] is True and "error" in failed and "skip_reason" not in failed
    assert skipped["skip_reason"] == "when" and "retrying" not in skipped and "parent" not in skipped
    assert "".join(data["text"] for kind, data in events if kind == "delta") == "Restart the router."
    assert events[-1][0] == "done"
    done = [(s["id"], s["status"], s["attempt"], s.get("skip_reason")) for s in events[-1][1]["stages"]]
    assert done == [("classify", "failed", 1, None), ("classify", "ok", 2, None), ("refund", "skipped", 1, "when"),
                    ("answer", "ok", 1, None)]
    assert events[-1][1]["stages"][1]["started_ms"] >= events[-1][1]["stages"][0]["started_ms"]


def test_a_sub_pipeline_step_names_its_parent():
    assert stage_event(StageStarted("answer", "llm", 1, "call")) == {
        "id": "answer", "type": "llm", "status": "started", "attempt": 1, "parent": "call"}
    finished = stage_event(StageFinished("answer", "llm", "ok", 0.25, 0.001, attempt=2, parent="call"))
    assert finished == {"id": "answer", "type": "llm", "status": "ok", "duration_ms": 250.0, "cost_usd": 0.001,
                        "attempt": 2, "parent": "call"}


def test_a_sub_pipelines_steps_are_sent_live_under_their_step(flow_client):
    response = flow_client.post("/pipelines/outer", json={"input": "my router is down", "stream": True})
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    stages = [(d["id"], d["status"], d.get("parent", "")) for kind, d in events if kind == "stage"]
    assert stages[0] == ("call", "started", "") and stages[-1] == ("call", "ok", "")
    assert ("classify", "failed", "call") in stages and ("answer", "ok", "call") in stages  # live, as they ran
    kinds = [(kind, d.get("id")) for kind, d in events]
    assert kinds.index(("stage", "answer")) < kinds.index(("delta", None)) < kinds.index(("stage", "call"), 1)
    assert "".join(d["text"] for kind, d in events if kind == "delta") == "Restart the router."


def test_count_tokens_counts_the_answering_steps_prompt(flow_client):
    ask = {"model": "flow", "messages": [{"role": "user", "content": "my router is down"}]}
    counted = flow_client.post("/v1/messages/count_tokens", json=ask)
    assert counted.status_code == 200, counted.text
    # The answering step's system prompt is part of what its model gets: counted, as a chain's prompt stage's is
    # (the fake tokenizer: a token per byte of "<role>content" per message).
    prompt = b"<system>You are tech support; answer in two sentences.<user>my router is down"
    assert counted.json() == {"input_tokens": len(prompt)}
