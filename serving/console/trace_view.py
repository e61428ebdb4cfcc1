"""What the trace view draws: one request's stages as a waterfall, with TTFT marked.

Two sources give the same :class:`TraceView`. A recent request comes from the
console's ring (serving/console/trace_ring.py), with each stage's measured
start offset. An older one comes from its audit record, which keeps each step's
start offset (``step.started_ms``, so steps that ran side by side are drawn side
by side) and which attempt, parent and skip reason it was of; a record written
before steps were kept has durations only, and then stages ran one after another,
so each start is taken as the sum of the durations before it (the view says so).
The audit stage, which writes the record, is not in it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pipeline.context import StageRecord
from serving.console.trace_ring import TraceEntry

#: The narrowest bar drawn, in percent of the request: a 0.1 ms stage stays visible.
_MIN_BAR_PCT = 0.4


@dataclass(frozen=True, slots=True)
class Row:
    """One stage's bar (the stage's own record, placed on the request's time axis) and its key attributes."""

    stage: StageRecord
    attributes: tuple[tuple[str, str], ...]
    x_pct: float
    width_pct: float

    @property
    def id(self) -> str:
        return self.stage.id

    @property
    def type(self) -> str:
        return self.stage.type

    @property
    def status(self) -> str:
        return self.stage.status

    @property
    def cost_usd(self) -> float:
        return self.stage.cost_usd

    @property
    def error(self) -> str:
        return self.stage.error

    @property
    def label(self) -> str:
        """Which run of which step it is (``id``, ``id[2]`` for an item, ``id@3`` for a loop's round), under the
        step it ran in (a sub-pipeline's steps)."""
        return f"{self.stage.parent} / {self.stage.key}" if self.stage.parent else self.stage.key

    @property
    def start_ms(self) -> float:
        return self.stage.started_s * 1e3

    @property
    def duration_ms(self) -> float:
        return self.stage.duration_s * 1e3


@dataclass(frozen=True, slots=True)
class TraceView:
    """A request's trace, ready to render."""

    source: str  # "live" (the console's ring) or "audit" (the audit record)
    request_id: str
    trace_id: str
    pipeline: str
    received_at: str
    status: str
    duration_ms: float
    ttft_ms: float | None
    ttft_pct: float | None
    cost_usd: float
    input_tokens: int
    output_tokens: int
    model: str
    finish_reason: str
    key_id: str | None
    rows: tuple[Row, ...]
    policy: tuple[dict[str, Any], ...] = ()
    retrieval: dict[str, Any] | None = None
    record_id: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def span_ms(self) -> float:
        """The time axis: the request's duration, or the last stage's end if that is later."""
        return _span(self.duration_ms, [row.stage for row in self.rows])


def from_entry(entry: TraceEntry) -> TraceView:
    """The view of a request the console saw itself."""
    facts = {**entry.facts, "model": entry.model, "prompt_tokens": entry.prompt_tokens,
             "input_tokens": entry.input_tokens, "output_tokens": entry.output_tokens,
             "finish_reason": entry.finish_reason}
    return _view("live", entry.stages, entry.decisions, facts, entry.duration_ms, entry.ttft_ms,
                 request_id=entry.request_id,
                 trace_id=entry.trace_id, pipeline=entry.pipeline, received_at=_iso(entry.received_at),
                 status=entry.status, cost_usd=entry.cost_usd, input_tokens=entry.input_tokens,
                 output_tokens=entry.output_tokens, model=entry.model, finish_reason=entry.finish_reason,
                 key_id=entry.key_id, policy=tuple(entry.facts.get("policy") or ()),
                 retrieval=entry.facts.get("retrieval"))


def from_record(record: dict[str, Any]) -> TraceView:
    """The view of a request read back from its audit record (see the module docstring)."""
    stages: list[StageRecord] = []
    decisions: dict[str, Any] = {}
    summed_s = 0.0
    measured = True
    for stage in record.get("stages") or ():
        duration_s = float(stage.get("duration_ms") or 0.0) / 1e3
        step = stage.get("step") or {}
        measured = measured and "started_ms" in step
        stages.append(StageRecord(str(stage.get("stage_id", "")), str(stage.get("type", "")),
                                  str(stage.get("status", "")),
                                  float(step["started_ms"]) / 1e3 if "started_ms" in step else summed_s, duration_s,
                                  float(stage.get("cost_usd") or 0.0), attempt=int(step.get("attempt") or 1),
                                  skip_reason=str(step.get("skip_reason") or ""),
                                  parent=str(step.get("parent") or ""), item=step.get("item"),
                                  round=int(step.get("round") or 0)))
        decisions[stages[-1].id] = stage.get("decision")
        summed_s += duration_s
    facts = {"route": record.get("route"), "retrieval": record.get("retrieval"), "policy": record.get("policy"),
             "sampling": record.get("params"), "model": record.get("model") or "",
             "input_tokens": record.get("input_tokens") or 0, "output_tokens": record.get("output_tokens") or 0,
             "finish_reason": record.get("finish_reason") or ""}
    notes = ("From the audit record: the audit stage that wrote it is not in it.",) if measured and stages else \
        ("From the audit record: it keeps each stage's duration, not its start, so starts are the sum "
         "of the durations before them; the audit stage that wrote the record is not in it.",)
    return _view("audit", stages, decisions, facts, float(record.get("duration_ms") or 0.0), record.get("ttft_ms"),
                 request_id=record.get("request_id") or "", trace_id=record.get("trace_id") or "",
                 pipeline=record.get("pipeline") or "", received_at=str(record.get("received_at") or ""),
                 status=record.get("status") or "", cost_usd=float(record.get("cost_usd") or 0.0),
                 input_tokens=int(record.get("input_tokens") or 0),
                 output_tokens=int(record.get("output_tokens") or 0), model=record.get("model") or "",
                 finish_reason=record.get("finish_reason") or "", key_id=record.get("key_id"),
                 policy=tuple(record.get("policy") or ()), retrieval=record.get("retrieval"),
                 record_id=record.get("id"), notes=notes)


def _view(source: str, stages: Sequence[StageRecord], decisions: Mapping[str, Any], facts: dict[str, Any],
          duration_ms: float, ttft_ms: float | None, **fields: Any) -> TraceView:
    span = max(_span(duration_ms, stages), 1e-6)
    rows = tuple(Row(s, attributes(s.type, decisions.get(s.id), facts) if s.status != "skipped" else (),
                     x_pct=min(100.0, 100.0 * s.started_s * 1e3 / span),
                     width_pct=max(_MIN_BAR_PCT, 100.0 * s.duration_s * 1e3 / span) if s.status != "skipped" else 0.0)
                 for s in stages)
    ttft_pct = None if ttft_ms is None else min(100.0, 100.0 * ttft_ms / span)
    return TraceView(source=source, duration_ms=duration_ms, ttft_ms=ttft_ms, ttft_pct=ttft_pct, rows=rows,
                     **fields)


def _span(duration_ms: float, stages: Iterable[StageRecord]) -> float:
    return max([duration_ms, *((s.started_s + s.duration_s) * 1e3 for s in stages)])


def attributes(stage_type: str, decision: Any, facts: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The attributes a reader of this stage wants first (model, tokens, documents, decisions), then
    whatever else the stage decided."""
    out: dict[str, str] = {}
    route = facts.get("route") or {}
    retrieval = facts.get("retrieval") or {}
    if stage_type == "retrieve" and retrieval:
        out["index"] = f"{retrieval.get('index', '')} v{retrieval.get('version', '')}".strip()
        out["documents"] = str(len(retrieval.get("ids") or ()))
        scores = retrieval.get("scores") or ()
        if scores:
            out["top score"] = f"{max(scores):.3f}"
    elif stage_type == "route" and route:
        out["model"] = str(route.get("model", ""))
        out["reason"] = str(route.get("reason", ""))
    elif stage_type == "tokenize":
        _put(out, "model", facts.get("model"))
        _put(out, "prompt tokens", facts.get("prompt_tokens"))
    elif stage_type == "generate":
        _put(out, "model", facts.get("model"))
        _put(out, "input tokens", facts.get("input_tokens"))
        sampling = facts.get("sampling") or {}
        for name in ("temperature", "max_tokens", "seed"):
            _put(out, name, sampling.get(name))
    elif stage_type == "stream":
        _put(out, "output tokens", facts.get("output_tokens"))
        _put(out, "finish reason", facts.get("finish_reason"))
    elif stage_type == "cache":
        cache = facts.get("cache") or (decision if isinstance(decision, dict) else {})
        if cache:
            out["cache"] = "hit" if cache.get("hit") else "miss"
    if isinstance(decision, dict):
        for name, value in decision.items():
            out.setdefault(name.replace("_", " "), _compact(value))
    elif decision is not None:
        out.setdefault("decision", _compact(decision))
    return tuple((k, v) for k, v in out.items() if v != "")


def _put(out: dict[str, str], name: str, value: Any) -> None:
    if value is not None and value != "":
        out[name] = _compact(value)


def _compact(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(", ", ": "), default=str)


def _iso(value: datetime) -> str:
    return value.isoformat(timespec="milliseconds")
