"""serving/http/metrics.py: per-pipeline and per-stage series, through a real prometheus_client registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pipeline.context import Usage
from pipeline.events import StageRecord, Summary
from serving.http.metrics import HttpMetrics


def summary(pipeline: str, *stages: StageRecord) -> Summary:
    return Summary("r", "0" * 32, pipeline, 0.2, 0.05, 0.001, stages, Usage(3, 4), "hi", "stop")


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_each_series_counts_its_own_requests_however_often_it_is_recorded():
    registry = CollectorRegistry()
    metrics = HttpMetrics(registry)
    ok = StageRecord("gen", "generate", "ok", 0.0, 0.1)
    failed = StageRecord("gen", "generate", "failed", 0.0, 0.1)
    for _ in range(3):
        metrics.observe(summary("chat", ok), "ok")
    metrics.observe(summary("chat", failed), "failed")
    metrics.observe(summary("rag", ok), "ok")
    assert value(registry, "inferline_pipeline_requests_total", pipeline="chat", status="ok") == 3
    assert value(registry, "inferline_pipeline_requests_total", pipeline="chat", status="failed") == 1
    assert value(registry, "inferline_pipeline_requests_total", pipeline="rag", status="ok") == 1
    stage = {"pipeline": "chat", "stage": "gen", "type": "generate"}
    assert value(registry, "inferline_stage_runs_total", **stage, status="ok") == 3
    assert value(registry, "inferline_stage_runs_total", **stage, status="failed") == 1
    assert value(registry, "inferline_stage_errors_total", **stage) == 1
    assert value(registry, "inferline_stage_duration_seconds_count", **stage) == 4
    assert value(registry, "inferline_pipeline_cost_usd_total", pipeline="chat") == pytest.approx(0.004)


def test_two_registries_keep_their_own_series():
    first, second = CollectorRegistry(), CollectorRegistry()
    one, two = HttpMetrics(first), HttpMetrics(second)
    one.observe(summary("chat"), "ok")
    one.observe(summary("chat"), "ok")
    two.observe(summary("chat"), "ok")
    assert value(first, "inferline_pipeline_requests_total", pipeline="chat", status="ok") == 2
    assert value(second, "inferline_pipeline_requests_total", pipeline="chat", status="ok") == 1
