"""Stored evaluation runs (``inferline eval``): one row per run, one per case, to list and compare later.

    store = EvalRunStore(engine)
    run_id = store.save(summary, results)      # summary: the report's JSON; results: one dict per case
    store.list_runs(pipeline="rag")           # newest first
    store.resolve("last", pipeline="rag")     # a run id from "last", a full id or a unique prefix
    run, results = store.get(run_id)
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from store.db import Base, UTCDateTime, utcnow

_MIN_PREFIX = 4


class EvalRun(Base):
    """One evaluation of a pipeline over a dataset."""

    __tablename__ = "eval_runs"
    __table_args__ = (sa.Index("ix_eval_runs_pipeline_created_at", "pipeline", "created_at"),)

    id: Mapped[str] = mapped_column(sa.String(36), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    pipeline: Mapped[str] = mapped_column(sa.String(200))
    pipeline_version: Mapped[str] = mapped_column(sa.String(64))
    spec_sha256: Mapped[str] = mapped_column(sa.String(64))
    """SHA-256 of the pipeline's YAML: which exact spec was evaluated."""
    dataset: Mapped[str] = mapped_column(sa.String(500))
    dataset_sha256: Mapped[str] = mapped_column(sa.String(64))
    """SHA-256 of the dataset file: a comparison with another run says when the cases differ."""
    num_cases: Mapped[int] = mapped_column(sa.Integer)
    pass_rate: Mapped[float] = mapped_column(sa.Float)
    """Fraction of cases that passed every one of their checks."""
    baseline_id: Mapped[str | None] = mapped_column(sa.String(36))
    """The run this one was compared with (--baseline), if any."""
    summary: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    """The report's JSON: pass rates per check, latency percentiles, tokens and cost."""


class EvalResult(Base):
    """One case of a run: the answer, each check's verdict, and what the request measured."""

    __tablename__ = "eval_results"

    run_id: Mapped[str] = mapped_column(sa.ForeignKey("eval_runs.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    """The case's line in the dataset (1-based)."""
    case_id: Mapped[str] = mapped_column(sa.String(200))
    status: Mapped[str] = mapped_column(sa.String(16))
    """The request's status: ok, failed, denied or cancelled."""
    passed: Mapped[bool] = mapped_column(sa.Boolean)
    checks: Mapped[list[dict[str, Any]]] = mapped_column(sa.JSON)
    """Each check's name, type, passed, score and detail."""
    output: Mapped[str] = mapped_column(sa.Text)
    """The answer (dataset inputs are test data, not callers' content)."""
    ttft_ms: Mapped[float | None] = mapped_column(sa.Float)
    itl_ms: Mapped[float | None] = mapped_column(sa.Float)
    e2e_ms: Mapped[float] = mapped_column(sa.Float)
    input_tokens: Mapped[int] = mapped_column(sa.Integer)
    output_tokens: Mapped[int] = mapped_column(sa.Integer)
    cost_usd: Mapped[float] = mapped_column(sa.Float)
    request_id: Mapped[str] = mapped_column(sa.String(64))
    """The request's id: its audit record and trace."""


_RUN_COLUMNS = ("id", "created_at", "pipeline", "pipeline_version", "spec_sha256", "dataset", "dataset_sha256",
                "num_cases", "pass_rate", "baseline_id")
_RESULT_COLUMNS = ("position", "case_id", "status", "passed", "checks", "output", "ttft_ms", "itl_ms", "e2e_ms",
                   "input_tokens", "output_tokens", "cost_usd", "request_id")


class UnknownRun(LookupError):
    """No stored run matches a reference (or several do)."""


class EvalRunStore:
    """Saves, lists and reads evaluation runs."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine

    def save(self, summary: dict[str, Any], results: list[dict[str, Any]], *, baseline_id: str | None = None,
             created_at: datetime | None = None) -> str:
        """Store a run (its id is ``summary["run_id"]`` if set, else a new one); its id."""
        run_id = summary.get("run_id") or str(uuid.uuid4())
        row = {"id": run_id, "created_at": created_at or utcnow(),
               "pipeline": summary["pipeline"], "pipeline_version": summary.get("pipeline_version", ""),
               "spec_sha256": summary.get("spec_sha256", ""), "dataset": summary.get("dataset", ""),
               "dataset_sha256": summary.get("dataset_sha256", ""), "num_cases": len(results),
               "pass_rate": summary.get("pass_rate") or 0.0, "baseline_id": baseline_id,
               "summary": summary}
        with self.engine.begin() as conn:
            conn.execute(sa.insert(EvalRun), [row])
            if results:
                conn.execute(sa.insert(EvalResult), [{"run_id": run_id, **{c: r.get(c) for c in _RESULT_COLUMNS}}
                                                     for r in results])
        return run_id

    def list_runs(self, pipeline: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        """Runs, newest first (without their cases)."""
        query = sa.select(*(getattr(EvalRun, c) for c in _RUN_COLUMNS)).order_by(EvalRun.created_at.desc())
        if pipeline:
            query = query.where(EvalRun.pipeline == pipeline)
        with self.engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query.limit(limit))]

    def resolve(self, ref: str, pipeline: str | None = None) -> str:
        """The id of the run *ref* names: ``last`` (the pipeline's newest), a full id, or a unique prefix."""
        with self.engine.connect() as conn:
            if ref == "last":
                query = sa.select(EvalRun.id).order_by(EvalRun.created_at.desc()).limit(1)
                if pipeline:
                    query = query.where(EvalRun.pipeline == pipeline)
                found = conn.scalar(query)
                if found is None:
                    raise UnknownRun(f"no stored eval run{f' of pipeline {pipeline!r}' if pipeline else ''} "
                                     "to use as 'last'")
                return found
            if len(ref) < _MIN_PREFIX:
                raise UnknownRun(f"run id {ref!r} is too short: give at least {_MIN_PREFIX} characters, or 'last'")
            ids = list(conn.scalars(sa.select(EvalRun.id).where(EvalRun.id.startswith(ref, autoescape=True))
                                    .limit(2)))
        if len(ids) != 1:
            raise UnknownRun(f"no stored eval run {ref!r}" if not ids else f"run id {ref!r} is ambiguous")
        return ids[0]

    def get(self, run_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A run's summary (the report's JSON) and its cases in dataset order."""
        with self.engine.connect() as conn:
            summary = conn.scalar(sa.select(EvalRun.summary).where(EvalRun.id == run_id))
            if summary is None:
                raise UnknownRun(f"no stored eval run {run_id!r}")
            query = (sa.select(*(getattr(EvalResult, c) for c in _RESULT_COLUMNS))
                     .where(EvalResult.run_id == run_id).order_by(EvalResult.position))
            results = [dict(row._mapping) for row in conn.execute(query)]
        return dict(summary) | {"run_id": run_id}, results
