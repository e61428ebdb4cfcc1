"""Route and cache over HTTP (in-process app, fake engines): decisions in audit and metrics."""

from __future__ import annotations

import textwrap

import pytest
from litestar.testing import TestClient

from pipeline.errors import BackendError
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import write_workspace

ROUTED = """
name: routed
stages:
  - {id: prompt, type: prompt}
  - {id: pick, type: route, with: {rules: [{when: "tags.fail == 'yes'", model: smol}], default: big,
                                   fallback: [big], context_check: false}}
  - {id: tok, type: tokenize}
  - {id: cache, type: cache, with: {ttl_s: 60}}
  - {id: gen, type: generate, with: {max_tokens: 32, temperature: 0}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true}
"""


class Down(FakeEngine):
    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        raise BackendError("engine down")


@pytest.fixture
def client(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    config.write_text(config.read_text().replace("models:\n", "models:\n  big: {source: models/x}\n"))
    (tmp_path / "pipelines" / "routed.yaml").write_text(textwrap.dedent(ROUTED))
    big = FakeEngine("From the big model.")
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=Down(), big=big))
    with TestClient(app) as test_client:
        test_client.big = big
        yield test_client


def test_fallback_and_cache_hit_are_in_the_audit_record_and_metrics(client):
    first = client.post("/pipelines/routed", json={"input": "Hello"})
    second = client.post("/pipelines/routed", json={"input": "Hello"})
    failed_over = client.post("/pipelines/routed", json={"input": "Hi", "tags": {"fail": "yes"}})
    assert first.json()["output"] == second.json()["output"] == failed_over.json()["output"] == "From the big model."
    assert len(client.big.submitted) == 2  # the second came from the cache
    # The answer names the model that answered, and the ones tried before it.
    assert failed_over.json()["model"] == "big" and failed_over.json()["fallbacks_tried"] == ["smol"]
    assert failed_over.headers["x-inferline-model"] == "big" and first.json()["fallbacks_tried"] == []
    records = client.get("/audit/records", params={"pipeline": "routed", "sort": "received_at"}).json()["records"]
    details = [client.get(f"/audit/records/{r['id']}").json() for r in records]
    assert [d["route"].get("served_by") for d in details] == ["big", None, "big"]  # None: from the cache
    assert details[2]["route"]["fallbacks_tried"] == [{"model": "smol", "attempt": 1, "error": "backend_error"}]
    decisions = [{s["stage_id"]: s["decision"] for s in d["stages"]} for d in details]
    assert [d["cache"]["hit"] for d in decisions] == [False, True, False]
    assert decisions[2]["pick"]["model"] == "smol" and decisions[2]["pick"]["mode"] == "rule"
    metrics = client.get("/metrics").text
    assert 'inferline_cache_lookups_total{pipeline="routed",result="hit"} 1.0' in metrics
    assert 'inferline_cache_lookups_total{pipeline="routed",result="miss"} 2.0' in metrics
