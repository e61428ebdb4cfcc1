"""The live-metrics sampler: histogram quantiles, rates and windows over a real Prometheus registry."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serving.console.metrics_sampler import MetricsSampler, quantile


def test_quantile_interpolates_within_buckets_like_prometheus():
    buckets = {0.1: 10.0, 0.2: 30.0, 0.4: 40.0, math.inf: 40.0}
    assert quantile(0.5, buckets) == pytest.approx(0.15)  # rank 20: halfway through (0.1, 0.2]
    assert quantile(0.25, buckets) == pytest.approx(0.1)
    assert quantile(0.1, buckets) == pytest.approx(0.04)  # the first bucket starts at 0
    assert quantile(0.99, buckets) == pytest.approx(0.2 + 0.2 * (39.6 - 30) / 10)
    assert quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None
    assert quantile(0.99, {1.0: 1.0, math.inf: 10.0}) == 1.0  # past the last finite bound: that bound


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sampler_rates_percentiles_and_gaps():
    registry = CollectorRegistry()
    requests = Counter("inferline_pipeline_requests", "", ["pipeline", "status"], registry=registry)
    cost = Counter("inferline_pipeline_cost_usd", "", ["pipeline"], registry=registry)
    ttft = Histogram("inferline_pipeline_time_to_first_token_seconds", "", ["pipeline"], registry=registry,
                     buckets=(0.1, 0.2, 0.4))
    waiting = Gauge("inferline_num_requests_waiting", "", ["model_name"], registry=registry)
    kv = Gauge("inferline_kv_cache_usage_perc", "", ["model_name"], registry=registry)
    queries = Counter("inferline_prefix_cache_queries", "", ["model_name"], registry=registry)
    hits = Counter("inferline_prefix_cache_hits", "", ["model_name"], registry=registry)
    clock = Clock()
    sampler = MetricsSampler(registry, interval_s=2.0, window_s=60.0, clock=clock)

    first = sampler.sample()
    assert first["rps"] is None and first["ttft_p50_ms"] is None and first["cost_per_request_usd"] is None

    clock.now += 2.0
    for pipeline in ("a", "b"):
        requests.labels(pipeline, "ok").inc(2)
        cost.labels(pipeline).inc(0.02)
        for _ in range(2):
            ttft.labels(pipeline).observe(0.15)
    waiting.labels("smol").set(3)
    waiting.labels("big").set(1)
    kv.labels("smol").set(0.25)
    kv.labels("big").set(0.5)
    queries.labels("smol").inc(100)
    hits.labels("smol").inc(40)
    point = sampler.sample()
    assert point["rps"] == pytest.approx(2.0)  # 4 requests in 2 s
    assert point["ttft_p50_ms"] == pytest.approx(150.0) and point["ttft_p99_ms"] <= 200.0
    assert point["queue_depth"] == 4 and point["kv_cache_usage"] == 0.5
    assert point["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert point["cost_per_request_usd"] == pytest.approx(0.01)
    assert point["itl_p50_ms"] is None  # no engine in this registry: a gap, not a zero

    clock.now += 120.0  # a quiet two minutes: the window holds no request any more
    quiet = sampler.sample()
    assert quiet["rps"] == 0.0 and quiet["requests_in_window"] == 0
    assert quiet["ttft_p50_ms"] is None and quiet["cost_per_request_usd"] is None
    assert quiet["queue_depth"] == 4  # gauges are what they are now
    assert len(sampler.points()) == 3  # fresh enough: points() does not sample again


def test_points_samples_when_stale():
    clock = Clock()
    sampler = MetricsSampler(CollectorRegistry(), interval_s=2.0, clock=clock)
    assert len(sampler.points()) == 1
    clock.now += 5
    assert len(sampler.points()) == 2
