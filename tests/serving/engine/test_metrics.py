from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from serving.engine.metrics import EngineMetrics

HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "decode_step_seconds", "prefill_step_seconds"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
COUNTERS = ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
            "decode_step_sequences"]


def value(metrics: EngineMetrics, sample: str, model_name: str | None = None) -> float | None:
    return metrics.registry.get_sample_value(sample, {"model_name": model_name or metrics.model_name})


def feed(metrics: EngineMetrics) -> None:
    metrics.observe_first_token(ttft_s=0.5, queue_s=0.1)
    metrics.observe_first_token(ttft_s=1.5, queue_s=0.3)
    metrics.observe_token(0.01)
    metrics.observe_tokens([0.02, 0.03, 0.04])
    metrics.observe_finished(2.0)
    metrics.set_gauges(running=3, waiting=2, kv_usage=0.25)
    metrics.add_prefix(queries=100, hits=40)
    metrics.add_prefix(queries=60, hits=0)
    metrics.add_preemptions(2)
    metrics.add_tokens(prompt=160, generated=5)
    metrics.add_tokens(prompt=0, generated=3)
    metrics.observe_step(0.3, num_prompt_tokens=120, num_decodes=2)
    metrics.observe_step(0.05, num_prompt_tokens=0, num_decodes=4)
    metrics.observe_step(0.07, num_prompt_tokens=0, num_decodes=2)


def test_every_series_is_exposed_with_the_model_label():
    metrics = EngineMetrics("smollm2")
    feed(metrics)
    text = generate_latest(metrics.registry).decode()
    expected = ([f"inferline_{name}_count" for name in HISTOGRAMS] + [f"inferline_{name}" for name in GAUGES]
                + [f"inferline_{name}_total" for name in COUNTERS])
    for sample in expected:
        assert f'{sample}{{model_name="smollm2"}}' in text
    assert 'inferline_time_to_first_token_seconds_bucket{le="640.0",model_name="smollm2"} 2.0' in text


def test_exposed_values_match_what_was_observed():
    metrics = EngineMetrics("m")
    feed(metrics)
    assert value(metrics, "inferline_time_to_first_token_seconds_sum") == pytest.approx(2.0)
    assert value(metrics, "inferline_inter_token_latency_seconds_count") == 4
    assert value(metrics, "inferline_request_queue_time_seconds_sum") == pytest.approx(0.4)
    assert value(metrics, "inferline_num_requests_running") == 3
    assert value(metrics, "inferline_kv_cache_usage_perc") == 0.25
    assert value(metrics, "inferline_prefix_cache_queries_total") == 160
    assert value(metrics, "inferline_prefix_cache_hits_total") == 40
    assert value(metrics, "inferline_num_preemptions_total") == 2
    assert value(metrics, "inferline_prompt_tokens_total") == 160
    assert value(metrics, "inferline_generation_tokens_total") == 8
    assert value(metrics, "inferline_prefill_step_seconds_count") == 1
    assert value(metrics, "inferline_decode_step_seconds_count") == 2
    assert value(metrics, "inferline_decode_step_seconds_sum") == pytest.approx(0.12)
    assert value(metrics, "inferline_decode_step_sequences_total") == 6  # a mean decode batch of 3


def test_snapshot_matches_what_was_observed():
    metrics = EngineMetrics("m")
    feed(metrics)
    snap = metrics.snapshot()
    assert snap["model_name"] == "m"
    assert (snap["num_requests_running"], snap["num_requests_waiting"], snap["kv_cache_usage_perc"]) == (3, 2, 0.25)
    assert (snap["prefix_cache_queries"], snap["prefix_cache_hits"]) == (160, 40)
    assert snap["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert (snap["num_preemptions"], snap["prompt_tokens"], snap["generation_tokens"]) == (2, 160, 8)
    assert snap["time_to_first_token_seconds"] == {"count": 2, "sum": 2.0, "p50": 1.0,
                                                   "p95": pytest.approx(1.45), "p99": pytest.approx(1.49)}
    assert snap["inter_token_latency_seconds"]["count"] == 4
    assert snap["inter_token_latency_seconds"]["sum"] == pytest.approx(0.1)
    assert snap["e2e_request_latency_seconds"] == {"count": 1, "sum": 2.0, "p50": 2.0, "p95": 2.0, "p99": 2.0}


def test_percentiles_interpolate_between_ranks():
    metrics = EngineMetrics("m")
    metrics.observe_tokens([float(v) for v in range(100, 0, -1)])  # 1..100, out of order
    itl = metrics.snapshot()["inter_token_latency_seconds"]
    assert (itl["p50"], itl["p95"], itl["p99"]) == (pytest.approx(50.5), pytest.approx(95.05), pytest.approx(99.01))


def test_percentiles_cover_the_recent_window_and_counts_all_time():
    metrics = EngineMetrics("m", window=3)
    metrics.observe_tokens([100.0, 1.0, 2.0, 3.0])
    itl = metrics.snapshot()["inter_token_latency_seconds"]
    assert (itl["count"], itl["sum"], itl["p50"], itl["p99"]) == (4, 106.0, 2.0, pytest.approx(2.98))


def test_an_empty_snapshot_has_no_percentiles():
    snap = EngineMetrics("m").snapshot()
    assert snap["time_to_first_token_seconds"] == {"count": 0, "sum": 0.0, "p50": None, "p95": None, "p99": None}
    assert snap["prefix_cache_hit_rate"] == 0.0
    assert snap["num_requests_waiting"] == 0


def test_engines_with_private_registries_do_not_collide():
    first, second = EngineMetrics("m"), EngineMetrics("m")
    first.add_tokens(prompt=10, generated=1)
    second.add_tokens(prompt=7, generated=0)
    assert first.registry is not second.registry
    assert value(first, "inferline_prompt_tokens_total") == 10
    assert value(second, "inferline_prompt_tokens_total") == 7
    assert second.snapshot()["prompt_tokens"] == 7


def test_engines_of_two_models_share_one_registry():
    registry = CollectorRegistry()
    small, large = EngineMetrics("small", registry), EngineMetrics("large", registry)
    small.add_preemptions(1)
    large.add_preemptions(4)
    large.observe_finished(3.0)
    assert value(small, "inferline_num_preemptions_total") == 1
    assert value(small, "inferline_num_preemptions_total", "large") == 4
    assert value(large, "inferline_e2e_request_latency_seconds_count") == 1
    assert value(small, "inferline_e2e_request_latency_seconds_count") == 0
    text = generate_latest(registry).decode()
    assert 'inferline_num_preemptions_total{model_name="small"} 1.0' in text
    assert 'inferline_num_preemptions_total{model_name="large"} 4.0' in text


def test_a_restarted_engine_reuses_the_shared_registry():
    registry = CollectorRegistry()
    EngineMetrics("m", registry).add_tokens(prompt=5, generated=0)
    restarted = EngineMetrics("m", registry)
    restarted.add_tokens(prompt=2, generated=0)
    assert value(restarted, "inferline_prompt_tokens_total") == 7  # Prometheus counters stay monotonic
    assert restarted.snapshot()["prompt_tokens"] == 2


def test_prefix_running_totals_add_only_what_is_new():
    metrics = EngineMetrics("m")
    metrics.set_prefix_totals(queries=100, hits=30)
    metrics.set_prefix_totals(queries=100, hits=30)
    metrics.set_prefix_totals(queries=164, hits=62)
    assert value(metrics, "inferline_prefix_cache_queries_total") == 164
    assert value(metrics, "inferline_prefix_cache_hits_total") == 62
    assert metrics.snapshot()["prefix_cache_hit_rate"] == pytest.approx(62 / 164)
