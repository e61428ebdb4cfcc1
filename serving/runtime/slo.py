"""Service-level objectives: judging one request, and attainment over many.

A pipeline declares ``slo: {ttft_ms_p95: 800, itl_ms_p95: 120, e2e_ms_p95: 8000,
max_cost_usd_per_request: 0.001}``. Each finished request is judged per objective
(:func:`judge`): met when its own figure is within the target. *Attainment* is the
fraction of judged requests that met an objective; a ``*_p95`` objective holds
when attainment is at least 95% (the observed p95 is then within the target), and
``max_cost_usd_per_request`` when it is 100%. ``all`` is the fraction of requests
that met every objective they were judged on (DistServe's "SLO attainment").

The same judgement serves the server's metrics, ``inferline load`` (from what
the client measured) and ``inferline plan`` (from simulated requests), so the
three agree on what "met" means:

* ``ttft``: arrival to the first text delta; requests that sent no text are not judged on it;
* ``itl``: (last token - first token) / (output tokens - 1), a request's mean inter-token
  latency (what vLLM's benchmarks call TPOT); judged from two output tokens on;
* ``e2e``: arrival to the final event;
* a request that failed misses every objective; denied and cancelled ones are not judged.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.events import Summary
from pipeline.spec import SLOSpec

#: Objective names, as in the YAML, in display order.
OBJECTIVES = ("ttft_ms_p95", "itl_ms_p95", "e2e_ms_p95", "max_cost_usd_per_request")
ALL = "all"
#: The attainment an objective needs to hold.
REQUIRED = {"ttft_ms_p95": 0.95, "itl_ms_p95": 0.95, "e2e_ms_p95": 0.95, "max_cost_usd_per_request": 1.0}
_FIGURE = {"ttft_ms_p95": "ttft_ms", "itl_ms_p95": "itl_ms", "e2e_ms_p95": "e2e_ms",
           "max_cost_usd_per_request": "cost_usd"}


@dataclass(frozen=True, slots=True)
class RequestFigures:
    """What one request measured; None where it does not apply (no text, one token)."""

    ok: bool
    ttft_ms: float | None
    itl_ms: float | None
    e2e_ms: float
    cost_usd: float

    def get(self, objective: str) -> float | None:
        return getattr(self, _FIGURE[objective])


def figures(summary: Summary, ok: bool = True) -> RequestFigures:
    """A finished request's figures, from its summary (server side)."""
    ttft_s = summary.ttft_s
    return RequestFigures(ok, None if ttft_s is None else ttft_s * 1e3,
                          itl_ms(ttft_s, summary.last_token_s, summary.usage.output_tokens),
                          summary.duration_s * 1e3, summary.cost_usd)


def itl_ms(first_s: float | None, last_s: float | None, num_output_tokens: int) -> float | None:
    """Mean inter-token latency in ms; None without two tokens."""
    if first_s is None or last_s is None or num_output_tokens < 2:
        return None
    return max(0.0, last_s - first_s) * 1e3 / (num_output_tokens - 1)


def judge(slo: SLOSpec, request: RequestFigures) -> dict[str, bool]:
    """Per objective of *slo*: met or not; objectives that do not apply to the request are left out.

    ``all`` is there whenever at least one objective was judged.
    """
    verdicts: dict[str, bool] = {}
    for objective in OBJECTIVES:
        target = getattr(slo, objective)
        if target is None:
            continue
        value = request.get(objective)
        if not request.ok:
            verdicts[objective] = False
        elif value is not None:
            verdicts[objective] = value <= target
    if verdicts:
        verdicts[ALL] = all(verdicts.values())
    return verdicts


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def attainment(slo: SLOSpec, requests: Iterable[RequestFigures]) -> dict[str, Any]:
    """Attainment of each objective over *requests*, with the observed p95 (max for cost) and
    whether the objective holds: ``{"ttft_ms_p95": {"target", "observed", "met", "judged", "attainment",
    "holds"}, ..., "all": {...}}``."""
    requests = list(requests)
    verdicts = [judge(slo, r) for r in requests]
    report: dict[str, Any] = {}
    for objective in (*OBJECTIVES, ALL):
        judged = [v[objective] for v in verdicts if objective in v]
        if objective != ALL and getattr(slo, objective) is None:
            continue
        entry: dict[str, Any] = {"judged": len(judged), "met": sum(judged),
                                 "attainment": round(sum(judged) / len(judged), 4) if judged else None}
        if objective != ALL:
            values = [v for r in requests if r.ok and (v := r.get(objective)) is not None]
            entry["target"] = getattr(slo, objective)
            entry["observed"] = (max(values, default=None) if objective == "max_cost_usd_per_request"
                                 else percentile(values, 95))
            entry["holds"] = None if not judged else sum(judged) / len(judged) >= REQUIRED[objective]
        report[objective] = entry
    return report


class SloWindow:
    """The figures of a pipeline's most recent requests, for attainment over a sliding window.

    Counts are kept as requests come and go, so recording one is O(objectives); the
    percentiles of :meth:`report` are computed when asked for.
    """

    def __init__(self, slo: SLOSpec, size: int = 1000):
        self.slo = slo
        self.size = size
        self._recent: deque[tuple[RequestFigures, dict[str, bool]]] = deque()
        self._judged: dict[str, int] = {}
        self._met: dict[str, int] = {}

    def add(self, request: RequestFigures) -> dict[str, bool]:
        """Record *request*; its verdicts."""
        verdicts = judge(self.slo, request)
        self._recent.append((request, verdicts))
        self._count(verdicts, 1)
        if len(self._recent) > self.size:
            self._count(self._recent.popleft()[1], -1)
        return verdicts

    def ratios(self) -> dict[str, float]:
        """Attainment of each objective judged in the window."""
        return {name: self._met[name] / count for name, count in self._judged.items() if count}

    def report(self) -> dict[str, Any]:
        return {"objectives": self.slo.model_dump(exclude_none=True), "window": self.size,
                "requests": len(self._recent), "attainment": attainment(self.slo, (r for r, _ in self._recent))}

    def _count(self, verdicts: dict[str, bool], step: int) -> None:
        for name, met in verdicts.items():
            self._judged[name] = self._judged.get(name, 0) + step
            self._met[name] = self._met.get(name, 0) + (step if met else 0)
