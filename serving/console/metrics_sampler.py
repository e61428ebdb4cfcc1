"""Live metrics for the console, sampled from the app's Prometheus registry.

Every ``interval_s`` the sampler reads the registry's cumulative series (the
same ones ``GET /metrics`` serves) and keeps the last ``history`` samples.
Each point of the charts compares a sample with earlier ones:

* requests per second: finished requests (``inferline_pipeline_requests``) since the previous sample;
* TTFT percentiles: ``inferline_pipeline_time_to_first_token_seconds``, the time to the first text
  as callers see it, over the last ``window_s``, interpolated within histogram buckets as
  Prometheus' ``histogram_quantile`` does;
* inter-token latency percentiles: the engines' ``inferline_inter_token_latency_seconds``, likewise;
* queue depth and running requests: the engines' gauges, summed over models;
* KV-cache usage: the fullest engine's ``inferline_kv_cache_usage_perc``;
* prefix-cache hit rate: prompt tokens found in the prefix cache over those looked up, in the window;
* cost per request: ``inferline_pipeline_cost_usd`` over finished requests, in the window.

A value with nothing to measure (no request in the window) is None: a gap in the chart, not a zero.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)

_TTFT = "inferline_pipeline_time_to_first_token_seconds"
_ITL = "inferline_inter_token_latency_seconds"
_QUANTILES = {"p50": 0.50, "p95": 0.95, "p99": 0.99}


@dataclass(slots=True)
class Sample:
    """The registry's cumulative values at one moment."""

    t: float  # time.time() of the sample
    requests: float = 0.0
    cost_usd: float = 0.0
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    #: histogram family -> {upper bound: cumulative count}, summed over label sets
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)


def read(registry: CollectorRegistry, now: float) -> Sample:
    """One :class:`Sample` of *registry*."""
    sample = Sample(now)
    for family in registry.collect():
        name = family.name
        for s in family.samples:
            if name == "inferline_pipeline_requests" and s.name.endswith("_total"):
                sample.requests += s.value
            elif name == "inferline_pipeline_cost_usd" and s.name.endswith("_total"):
                sample.cost_usd += s.value
            elif name == "inferline_num_requests_waiting":
                sample.waiting += s.value
            elif name == "inferline_num_requests_running":
                sample.running += s.value
            elif name == "inferline_kv_cache_usage_perc":
                sample.kv_usage = max(sample.kv_usage, s.value)
            elif name == "inferline_prefix_cache_queries" and s.name.endswith("_total"):
                sample.prefix_queries += s.value
            elif name == "inferline_prefix_cache_hits" and s.name.endswith("_total"):
                sample.prefix_hits += s.value
            elif name in (_TTFT, _ITL) and s.name.endswith("_bucket"):
                bound = float(s.labels["le"])
                counts = sample.buckets.setdefault(name, {})
                counts[bound] = counts.get(bound, 0.0) + s.value
    return sample


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The *q* quantile of a cumulative histogram (upper bound -> count), Prometheus-style; None if empty."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):  # beyond the last finite bucket: its bound is all that is known
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, count
    return lower


def point(now: Sample, previous: Sample | None, window_start: Sample | None) -> dict[str, Any]:
    """One chart point: rates against *previous*, percentiles and ratios over [*window_start*, *now*]."""
    out: dict[str, Any] = {"t": round(now.t, 3), "queue_depth": now.waiting, "running": now.running,
                           "kv_cache_usage": now.kv_usage}
    dt = now.t - previous.t if previous is not None else 0.0
    out["rps"] = max(0.0, now.requests - previous.requests) / dt if previous is not None and dt > 0 else None
    base = window_start or Sample(now.t)
    for family, prefix in ((_TTFT, "ttft"), (_ITL, "itl")):
        delta = _delta(now.buckets.get(family, {}), base.buckets.get(family, {}))
        for label, q in _QUANTILES.items():
            value = quantile(q, delta)
            out[f"{prefix}_{label}_ms"] = None if value is None else value * 1e3
    queries = now.prefix_queries - base.prefix_queries
    out["prefix_cache_hit_rate"] = (now.prefix_hits - base.prefix_hits) / queries if queries > 0 else None
    requests = now.requests - base.requests
    out["cost_per_request_usd"] = (now.cost_usd - base.cost_usd) / requests if requests > 0 else None
    out["requests_in_window"] = requests
    return out


def _delta(now: dict[float, float], then: dict[float, float]) -> dict[float, float]:
    return {bound: count - then.get(bound, 0.0) for bound, count in now.items()}


class MetricsSampler:
    """Samples *registry* every *interval_s* into a bounded history of chart points."""

    def __init__(self, registry: CollectorRegistry, *, interval_s: float = 2.0, history: int = 150,
                 window_s: float = 60.0, clock: Callable[[], float] = time.time):
        self.registry = registry
        self.interval_s = interval_s
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[Sample] = deque(maxlen=history + 1)
        self._points: deque[dict[str, Any]] = deque(maxlen=history)

    def sample(self) -> dict[str, Any]:
        """Read the registry now and append a point; returns it."""
        now = read(self.registry, self.clock())
        previous = self._samples[-1] if self._samples else None
        window_start = next((s for s in self._samples if s.t >= now.t - self.window_s), previous)
        self._samples.append(now)
        point_now = point(now, previous, window_start)
        self._points.append(point_now)
        return point_now

    def points(self) -> list[dict[str, Any]]:
        """The history, oldest first; sampled now too when the last sample is stale (no background task)."""
        if not self._samples or self.clock() - self._samples[-1].t >= self.interval_s:
            self.sample()
        return list(self._points)

    async def run(self) -> None:
        """Sample forever (the console's lifespan runs and cancels this)."""
        while True:
            try:
                self.sample()
            except Exception:  # a broken collector must not end the charts
                logger.exception("console: metrics sample failed")
            await asyncio.sleep(self.interval_s)
