"""Engine metrics: Prometheus series named after vLLM's, and a plain-number snapshot.

Each ``vllm:`` name becomes ``inferline_`` (``vllm:num_requests_running`` ->
``inferline_num_requests_running``), all labelled ``model_name``. Counters are exposed with the
``_total`` suffix, as vLLM's are (``inferline_prompt_tokens_total``). ``kv_cache_usage_perc`` is a
fraction in [0, 1], like vLLM's.

Serving ``/metrics`` is the server's job: it passes its registry to each engine's ``EngineMetrics``
and exposes it with ``prometheus_client.generate_latest``.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_PREFIX = "inferline_"
# A CPU prefill of a long prompt behind a queue can take minutes; a cached short one, milliseconds.
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                      160.0, 320.0, 640.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                  0.75, 1.0, 2.5, 5.0, 10.0)
_HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time from a request's arrival to its first output token.", _LATENCY_BUCKETS_S),
    "inter_token_latency_seconds": ("Time between two consecutive output tokens of a request.", _ITL_BUCKETS_S),
    "e2e_request_latency_seconds": ("Time from a request's arrival to its last token.", _LATENCY_BUCKETS_S),
    "request_queue_time_seconds": ("Time a request waited before it was first scheduled.", _LATENCY_BUCKETS_S),
    # Not vLLM's: the engine's own steps, to set against `inferline profile`'s (docs/capacity.md).
    "decode_step_seconds": ("Wall time of an engine step that ran decodes only (no prompt tokens).", _ITL_BUCKETS_S),
    "prefill_step_seconds": ("Wall time of an engine step that computed prompt tokens (decodes may ride along).",
                             _LATENCY_BUCKETS_S),
}
_GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting for admission.",
    "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (1 = full).",
}
_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "num_preemptions": "Sequences preempted to free KV-cache blocks.",
    "num_deadline_drops": "Requests dropped before prefill: still waiting at their deadline.",
    "prompt_tokens": "Prompt tokens prefilled.",
    "generation_tokens": "Output tokens generated.",
    "spec_decode_num_draft_tokens": "Tokens proposed by speculative decoding.",
    "spec_decode_num_accepted_tokens": "Proposed tokens the model accepted.",
    "decode_step_sequences": "Sequences of the decode-only steps, summed (over their count: the mean batch).",
}
_PERCENTILES = {"p50": 0.50, "p95": 0.95, "p99": 0.99}
#: The series vLLM itself has (under ``vllm:``), which routers and autoscalers read by those names.
VLLM_SERIES = frozenset({*_HISTOGRAMS, *_GAUGES, *_COUNTERS} - {"decode_step_seconds", "prefill_step_seconds",
                                                                 "num_deadline_drops", "decode_step_sequences"})


def with_vllm_names(exposition: str) -> str:
    """*exposition* (Prometheus text) with each of vLLM's series also under its ``vllm:`` name, and the
    KV-cache usage also as ``vllm:gpu_cache_usage_perc`` (vLLM's name before 0.10, which older endpoint
    pickers read)."""
    extra: list[str] = []
    for line in exposition.splitlines():
        body = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        if not body.startswith(_PREFIX):
            continue
        name = body[len(_PREFIX):].split("{", 1)[0].split(" ", 1)[0]
        family = next((f for f in VLLM_SERIES if name == f or name.startswith(f + "_")), None)
        if family is None:
            continue
        renamed = line.replace(_PREFIX + name, "vllm:" + name, 1)
        extra.append(renamed)
        if family == "kv_cache_usage_perc":
            extra.append(line.replace(_PREFIX + name, "vllm:gpu_cache_usage_perc", 1))
    return exposition + "".join(f"{line}\n" for line in extra)

# prometheus_client refuses to register a name twice in one registry, while engines of several
# models sharing the server's registry is the point of the model_name label: so the families are
# made once per registry. Weak keys: a registry dropped by its owner takes its families with it.
_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Any]] = weakref.WeakKeyDictionary()
_FAMILIES_LOCK = threading.Lock()


def _families(registry: CollectorRegistry) -> dict[str, Any]:
    with _FAMILIES_LOCK:
        families = _FAMILIES.get(registry)
        if families is None:
            families = {}
            for name, (doc, buckets) in _HISTOGRAMS.items():
                families[name] = Histogram(_PREFIX + name, doc, ["model_name"], registry=registry, buckets=buckets)
            for name, doc in _GAUGES.items():
                families[name] = Gauge(_PREFIX + name, doc, ["model_name"], registry=registry)
            for name, doc in _COUNTERS.items():
                families[name] = Counter(_PREFIX + name, doc, ["model_name"], registry=registry)
            _FAMILIES[registry] = families
        return families


@dataclass(slots=True)
class _Series:
    """All-time count and sum of a latency, and its most recent samples for percentiles."""

    recent: deque[float]
    count: int = 0
    total: float = 0.0

    def add(self, value: float) -> None:
        self.recent.append(value)
        self.count += 1
        self.total += value


@dataclass(slots=True)
class _State:
    series: dict[str, _Series]
    gauges: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_GAUGES, 0.0))
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))


class EngineMetrics:
    """One engine's metrics: Prometheus series in ``registry`` and numbers for ``snapshot()``.

    ``registry``: None gives this engine a private registry, so engines and tests never collide;
    pass the server's registry to expose several engines together (give them distinct
    ``model_name``s: two engines with one name add into the same series). The observe, set and add
    methods are cheap and called from the engine thread; ``snapshot`` may run on any thread.
    Percentiles are over the last ``window`` samples of each latency.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, window: int = 2048):
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._children = {name: family.labels(model_name=model_name)
                          for name, family in _families(self.registry).items()}
        self._state = _State(series={name: _Series(deque(maxlen=window)) for name in _HISTOGRAMS})
        self._lock = threading.Lock()

    def observe_first_token(self, ttft_s: float, queue_s: float) -> None:
        """A request's first token: time to it from arrival, and time spent waiting to be scheduled."""
        self._observe("time_to_first_token_seconds", (ttft_s,))
        self._observe("request_queue_time_seconds", (queue_s,))

    def observe_token(self, itl_s: float) -> None:
        """One later token: time since the request's previous token."""
        self._observe("inter_token_latency_seconds", (itl_s,))

    def observe_tokens(self, itls_s: Iterable[float]) -> None:
        """A step's worth of :meth:`observe_token`, under one lock."""
        self._observe("inter_token_latency_seconds", itls_s)

    def observe_finished(self, e2e_s: float) -> None:
        """A finished request: time from arrival to its last token."""
        self._observe("e2e_request_latency_seconds", (e2e_s,))

    def observe_step(self, seconds: float, num_prompt_tokens: int, num_decodes: int) -> None:
        """One step's wall time, with the prompt tokens and the decoding sequences it computed."""
        if num_prompt_tokens:
            self._observe("prefill_step_seconds", (seconds,))
        else:
            self._observe("decode_step_seconds", (seconds,))
            self._add({"decode_step_sequences": num_decodes})

    def set_gauges(self, running: int, waiting: int, kv_usage: float) -> None:
        """The batch and queue sizes, and the KV-cache fraction in use, after a step."""
        values = {"num_requests_running": running, "num_requests_waiting": waiting, "kv_cache_usage_perc": kv_usage}
        with self._lock:
            for name, value in values.items():
                self._children[name].set(value)
                self._state.gauges[name] = value

    def add_prefix(self, queries: int, hits: int) -> None:
        """Prompt tokens looked up in the prefix cache, and how many of them were cached."""
        self._add({"prefix_cache_queries": queries, "prefix_cache_hits": hits})

    def set_prefix_totals(self, queries: int, hits: int) -> None:
        """Like :meth:`add_prefix`, from running totals (the block manager's): adds what is new."""
        counters = self._state.counters
        self._add({"prefix_cache_queries": max(0, queries - counters["prefix_cache_queries"]),
                   "prefix_cache_hits": max(0, hits - counters["prefix_cache_hits"])})

    def add_preemptions(self, num: int) -> None:
        self._add({"num_preemptions": num})

    def add_deadline_drops(self, num: int) -> None:
        self._add({"num_deadline_drops": num})

    def add_speculation(self, proposed: int, accepted: int) -> None:
        """Speculative decoding: tokens a step verified for one sequence, and how many it accepted."""
        self._add({"spec_decode_num_draft_tokens": proposed, "spec_decode_num_accepted_tokens": accepted})

    def add_tokens(self, prompt: int, generated: int) -> None:
        """Prompt tokens prefilled and output tokens generated (by a step, or by a request)."""
        self._add({"prompt_tokens": prompt, "generation_tokens": generated})

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers for ``engine.stats()``: gauges, counters, and per latency its all-time
        ``count`` and ``sum`` with ``p50``/``p95``/``p99`` of recent samples (None before any)."""
        with self._lock:
            state = self._state
            out: dict[str, Any] = {"model_name": self.model_name, **state.gauges, **state.counters}
            # Copied under the lock, sorted outside it: the engine thread never waits for a sort.
            latencies = {name: (series.count, series.total, list(series.recent))
                         for name, series in state.series.items()}
        for name, (count, total, recent) in latencies.items():
            out[name] = _summary(count, total, recent)
        queries = out["prefix_cache_queries"]
        out["prefix_cache_hit_rate"] = out["prefix_cache_hits"] / queries if queries else 0.0
        proposed = out["spec_decode_num_draft_tokens"]
        out["spec_decode_acceptance_rate"] = out["spec_decode_num_accepted_tokens"] / proposed if proposed else 0.0
        return out

    def _observe(self, name: str, values_s: Iterable[float]) -> None:
        child, series = self._children[name], self._state.series[name]
        with self._lock:
            for value in values_s:
                child.observe(value)
                series.add(value)

    def _add(self, amounts: dict[str, int]) -> None:
        with self._lock:
            for name, amount in amounts.items():
                if amount:  # most steps add nothing to most counters
                    self._children[name].inc(amount)
                    self._state.counters[name] += amount


def _summary(count: int, total: float, recent: list[float]) -> dict[str, float | int | None]:
    ordered = sorted(recent)
    out: dict[str, float | int | None] = {"count": count, "sum": total}
    out.update((key, _percentile(ordered, q)) for key, q in _PERCENTILES.items())
    return out


def _percentile(ordered: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no samples."""
    if not ordered:
        return None
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
