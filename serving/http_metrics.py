"""Per-pipeline and per-stage Prometheus metrics, beside the engines' own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pipeline.events import Summary

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class HttpMetrics:
    """Request counts, latencies, errors and cost by pipeline and stage."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("inferline_pipeline_requests", "Requests finished, by pipeline and status.",
                                ["pipeline", "status"], registry=registry)
        self.latency = Histogram("inferline_pipeline_request_duration_seconds", "End-to-end request latency.",
                                 ["pipeline"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram("inferline_pipeline_time_to_first_token_seconds", "Time to the first text delta.",
                              ["pipeline"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.cost = Counter("inferline_pipeline_cost_usd", "Cost of finished requests, in USD.", ["pipeline"],
                            registry=registry)
        self.stage_latency = Histogram("inferline_stage_duration_seconds", "Stage duration.",
                                       ["pipeline", "stage", "type"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.stage_runs = Counter("inferline_stage_runs", "Stage runs, by status.",
                                  ["pipeline", "stage", "type", "status"], registry=registry)
        self.cache = Counter("inferline_cache_lookups", "Response cache lookups, by result (hit, miss, skipped).",
                             ["pipeline", "result"], registry=registry)
        self.stage_errors = Counter("inferline_stage_errors", "Stage runs that failed or timed out.",
                                    ["pipeline", "stage", "type"], registry=registry)

    def observe_cache(self, pipeline: str, cache: dict[str, object] | None) -> None:
        if cache:
            result = "hit" if cache.get("hit") else "skipped" if cache.get("skipped") else "miss"
            self.cache.labels(pipeline, result).inc()

    def observe(self, summary: Summary, status: str) -> None:
        name = summary.pipeline
        self.requests.labels(name, status).inc()
        self.latency.labels(name).observe(summary.duration_s)
        if summary.ttft_s is not None:
            self.ttft.labels(name).observe(summary.ttft_s)
        self.cost.labels(name).inc(summary.cost_usd)
        for stage in summary.stages:
            self.stage_runs.labels(name, stage.id, stage.type, stage.status).inc()
            if stage.status == "skipped":
                continue
            self.stage_latency.labels(name, stage.id, stage.type).observe(stage.duration_s)
            if stage.status in ("failed", "timeout"):
                self.stage_errors.labels(name, stage.id, stage.type).inc()
