"""SLO attainment: judging requests, the sliding window, the metrics and GET /pipelines/{name}."""

from __future__ import annotations

import textwrap

import pytest
from litestar.testing import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.context import StageRecord, Usage
from pipeline.events import Summary
from pipeline.spec import SLOSpec
from serving.http.metrics import HttpMetrics
from serving.runtime.slo import RequestFigures, SloWindow, attainment, figures, judge
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import write_workspace

SLO = SLOSpec(ttft_ms_p95=100, itl_ms_p95=10, e2e_ms_p95=1000, max_cost_usd_per_request=0.01)


def summary(ttft_s=0.05, stream_end_s=0.5, tokens=10, duration_s=0.6, cost=0.001) -> Summary:
    stages = (StageRecord("gen", "generate", "ok", 0.0, 0.01), StageRecord("out", "stream", "ok", 0.01,
                                                                         stream_end_s - 0.01),
              StageRecord("log", "audit", "ok", stream_end_s, 0.05))
    return Summary("r", "t", "chat", duration_s, ttft_s, cost, stages, Usage(5, tokens), "text", "stop",
                   last_token_s=stream_end_s)


def test_a_request_is_judged_per_objective():
    measured = figures(summary())
    assert measured.ttft_ms == pytest.approx(50) and measured.e2e_ms == pytest.approx(600)
    assert measured.itl_ms == pytest.approx((500 - 50) / 9)  # first to last token over 9 gaps
    assert judge(SLO, measured) == {"ttft_ms_p95": True, "itl_ms_p95": False, "e2e_ms_p95": True,
                                    "max_cost_usd_per_request": True, "all": False}
    one_token = figures(summary(tokens=1))
    assert "itl_ms_p95" not in judge(SLO, one_token) and judge(SLO, one_token)["all"] is True
    failed = RequestFigures(False, None, None, 5.0, 0.0)
    assert set(judge(SLO, failed).values()) == {False}
    assert judge(SLOSpec(e2e_ms_p95=1), RequestFigures(True, None, None, 0.5, 0)) == {"e2e_ms_p95": True, "all": True}


def test_attainment_and_whether_each_objective_holds():
    requests = [RequestFigures(True, float(ms), 5.0, 500.0, 0.001) for ms in range(1, 101)]  # ttft 1..100 ms
    report = attainment(SLOSpec(ttft_ms_p95=95, max_cost_usd_per_request=0.01), requests)
    assert report["ttft_ms_p95"] == {"judged": 100, "met": 95, "attainment": 0.95, "target": 95.0,
                                     "observed": 95.0, "holds": True}
    assert report["max_cost_usd_per_request"]["holds"] is True and report["all"]["attainment"] == 0.95
    tighter = attainment(SLOSpec(ttft_ms_p95=90), requests)["ttft_ms_p95"]
    assert (tighter["attainment"], tighter["holds"]) == (0.9, False)


def test_the_window_forgets_old_requests():
    window = SloWindow(SLOSpec(e2e_ms_p95=100), size=3)
    for e2e in (500, 500, 50, 50, 50):
        window.add(RequestFigures(True, None, None, e2e, 0.0))
    assert window.ratios() == {"e2e_ms_p95": 1.0, "all": 1.0}
    window.add(RequestFigures(True, None, None, 500, 0.0))
    assert window.ratios()["e2e_ms_p95"] == pytest.approx(2 / 3)
    assert window.report()["attainment"]["e2e_ms_p95"]["observed"] == 500


def samples(registry: CollectorRegistry, name: str) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def test_metrics_count_met_and_missed():
    registry = CollectorRegistry()
    metrics = HttpMetrics(registry, {"chat": SLO, "other": None})
    metrics.observe(summary(), "ok")
    metrics.observe(summary(duration_s=5.0), "failed")
    metrics.observe(summary(), "denied")  # not the service's doing: not judged
    counted = samples(registry, "inferline_slo_requests_total")
    assert counted[(("objective", "e2e_ms_p95"), ("pipeline", "chat"), ("result", "met"))] == 1
    assert counted[(("objective", "e2e_ms_p95"), ("pipeline", "chat"), ("result", "missed"))] == 1
    assert counted[(("objective", "all"), ("pipeline", "chat"), ("result", "missed"))] == 2
    ratio = samples(registry, "inferline_slo_attainment_ratio")
    assert ratio[(("objective", "ttft_ms_p95"), ("pipeline", "chat"))] == 0.5
    assert metrics.slo_report("other") is None and metrics.slo_report("chat")["requests"] == 2


CHAT_SLO = """
name: chat
slo: {ttft_ms_p95: 60000, e2e_ms_p95: 60000, max_cost_usd_per_request: 0.000001}
stages:
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 64, temperature: 0}}
  - {id: out, type: stream}
"""


def test_describe_shows_attainment(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    (tmp_path / "pipelines" / "chat.yaml").write_text(textwrap.dedent(CHAT_SLO))
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))
    with TestClient(app) as client:
        assert client.get("/pipelines/chat").json()["slo"]["requests"] == 0
        for _ in range(3):
            assert client.post("/pipelines/chat", json={"input": "Capital?"}).status_code == 200
        slo = client.get("/pipelines/chat").json()["slo"]
        assert slo["objectives"] == {"ttft_ms_p95": 60000.0, "e2e_ms_p95": 60000.0, "max_cost_usd_per_request": 1e-06}
        assert slo["requests"] == 3 and slo["attainment"]["ttft_ms_p95"]["attainment"] == 1.0
        # Prices of 1 and 2 USD per 1k tokens: every request costs more than the objective allows.
        assert slo["attainment"]["max_cost_usd_per_request"] | {"observed": None} == {
            "judged": 3, "met": 0, "attainment": 0.0, "target": 1e-06, "observed": None, "holds": False}
        assert client.get("/pipelines").json()["pipelines"][0]["slo"]["requests"] == 3
        assert client.get("/pipelines/reviews").json()["slo"] is None
        metrics = client.get("/metrics").text
        assert 'inferline_slo_attainment_ratio{objective="all",pipeline="chat"} 0.0' in metrics
