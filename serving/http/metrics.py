"""Per-pipeline and per-stage Prometheus metrics, beside the engines' own.

With a pipeline's ``slo:``, each finished request is judged against its objectives
(serving/runtime/slo.py): ``inferline_slo_requests_total{pipeline, objective, result}`` counts
met and missed requests, ``inferline_slo_attainment_ratio`` is the attainment over the last
1,000 judged requests. A ``score`` stage's online checks (stages/score.py) land in
``inferline_online_eval_checks_total{pipeline, check, result}`` and the
``inferline_online_eval_score`` histogram.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from pipeline.events import Summary
from pipeline.spec import SLOSpec
from serving.runtime.slo import SloWindow, figures

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_SCORE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class HttpMetrics:
    """Request counts, latencies, errors and cost by pipeline and stage."""

    def __init__(self, registry: CollectorRegistry, slos: Mapping[str, SLOSpec | None] | None = None):
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
        self.slo_requests = Counter("inferline_slo_requests", "Requests judged against an SLO objective, by "
                                    "result (met, missed); objective 'all' is every objective at once.",
                                    ["pipeline", "objective", "result"], registry=registry)
        self.slo_attainment = Gauge("inferline_slo_attainment_ratio", "Fraction of the last 1,000 judged "
                                    "requests that met the objective.", ["pipeline", "objective"],
                                    registry=registry)
        self.online_checks = Counter("inferline_online_eval_checks", "Online-sampled requests' checks, by "
                                     "result (pass, fail, error).", ["pipeline", "check", "result"],
                                     registry=registry)
        self.online_scores = Histogram("inferline_online_eval_score", "Scores (0..1) of online-sampled "
                                       "requests' checks.", ["pipeline", "check"], buckets=_SCORE_BUCKETS,
                                       registry=registry)
        #: Pipeline name -> the sliding window of its SLO (pipelines with ``slo:`` only).
        self.slo_windows = {name: SloWindow(slo) for name, slo in (slos or {}).items() if slo is not None}
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}

    def _child(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """``metric.labels(*labels)``, kept: prometheus_client's ``labels`` checks its values and takes a lock
        on every call, and a request records about twenty series as it finishes, on the event loop. The label
        values are pipeline, stage and check names from the specs and fixed statuses: the cache holds one entry
        a series."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def set_slo(self, pipeline: str, slo: Any) -> None:
        """Follow a reloaded pipeline's ``slo:`` (None: it has none, or it was retired): a new window."""
        self.slo_windows.pop(pipeline, None)
        if slo is not None:
            self.slo_windows[pipeline] = SloWindow(slo)

    def slo_report(self, pipeline: str) -> dict[str, Any] | None:
        """The pipeline's objectives and their attainment over the window; None without ``slo:``."""
        window = self.slo_windows.get(pipeline)
        return None if window is None else window.report()

    def observe_online_eval(self, pipeline: str, scored: Mapping[str, Any] | None) -> None:
        """Count the checks a ``score`` stage ran (``ctx.facts["online_eval"]``)."""
        if not scored or not scored.get("sampled"):
            return
        for check in scored.get("checks", ()):
            result = "error" if check.get("error") else "pass" if check.get("passed") else "fail"
            self._child(self.online_checks, pipeline, check["name"], result).inc()
            if check.get("score") is not None:
                self._child(self.online_scores, pipeline, check["name"]).observe(check["score"])

    def _observe_slo(self, summary: Summary, status: str) -> None:
        window = self.slo_windows.get(summary.pipeline)
        if window is None or status not in ("ok", "failed"):  # denied and cancelled are not the service's
            return
        for objective, met in window.add(figures(summary, ok=status == "ok")).items():
            self._child(self.slo_requests, summary.pipeline, objective, "met" if met else "missed").inc()
        for objective, ratio in window.ratios().items():
            self._child(self.slo_attainment, summary.pipeline, objective).set(ratio)

    def observe_cache(self, pipeline: str, cache: dict[str, object] | None) -> None:
        if cache:
            result = "hit" if cache.get("hit") else "skipped" if cache.get("skipped") else "miss"
            self._child(self.cache, pipeline, result).inc()

    def observe_disconnected(self, pipeline: str) -> None:
        """A request whose client left before its final event."""
        self._child(self.requests, pipeline, "disconnected").inc()

    def observe(self, summary: Summary, status: str) -> None:
        name = summary.pipeline
        self._child(self.requests, name, status).inc()
        self._child(self.latency, name).observe(summary.duration_s)
        if summary.ttft_s is not None:
            self._child(self.ttft, name).observe(summary.ttft_s)
        self._child(self.cost, name).inc(summary.cost_usd)
        for stage in summary.stages:
            self._child(self.stage_runs, name, stage.id, stage.type, stage.status).inc()
            if stage.status == "skipped":
                continue
            self._child(self.stage_latency, name, stage.id, stage.type).observe(stage.duration_s)
            if stage.status in ("failed", "timeout"):
                self._child(self.stage_errors, name, stage.id, stage.type).inc()
        self._observe_slo(summary, status)
