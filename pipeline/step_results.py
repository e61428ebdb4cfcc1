"""What each step of a request gave, as one comparable string per run of a step: how a shadow run tells which
steps of a candidate version give something else than the version that served (serving/runtime/shadow.py, and
the shadow row of its audit record, stages/audit.py).

    differing_steps(step_results(served_ctx), step_results(shadow_ctx))   # -> ["judge", "redraft"]

A run of a step is named by where it ran and which run it is (``call/answer``, ``summarize[2]``, ``draft@3``:
:attr:`~pipeline.context.StageRecord.key` under its parent); its last attempt counts. Its result is its output's
SHA-256 when it ended ``ok``, else its status (and why it was skipped). A pipeline that audits records each run's
output; one that does not keeps only each step's last outputs (``ctx.steps``), which then stand for all of its
items and rounds, and a sub-pipeline's step of it compares by its status alone.
"""

from __future__ import annotations

import re

from pipeline.context import RequestContext, StageRecord
from pipeline.digest import digest

_RUN = re.compile(r"(\[\d+\])?(@\d+)?$")


def step_results(ctx: RequestContext) -> dict[str, str]:
    """Each run of a step of *ctx* (the audit step aside: it gives nothing), by its name, as a string that is the
    same for two runs exactly when they gave the same."""
    results: dict[str, str] = {}
    for record in ctx.stages:
        if record.type != "audit":
            results[step_run_name(record)] = _result(ctx, record)
    return results


def step_run_name(record: StageRecord) -> str:
    """Where a run of a step ran and which it is: ``id``, ``parent/id``, with ``[item]`` or ``@round``."""
    return f"{record.parent}/{record.key}" if record.parent else record.key


def step_of(name: str) -> str:
    """The step a run of it is of (:func:`step_run_name` without its item and round): what a metric counts by, as
    items are as many as a list is long."""
    return _RUN.sub("", name)


def differing_steps(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """The runs of steps, in *new*'s order then *old*'s, whose result is not the same in both (one that ran on
    one side only differs)."""
    return [name for name in dict.fromkeys([*new, *old]) if old.get(name) != new.get(name)]


def _result(ctx: RequestContext, record: StageRecord) -> str:
    if record.status != "ok":
        return f"{record.status}:{record.skip_reason}" if record.skip_reason else record.status
    if record.output_sha256:
        return record.output_sha256
    return digest(ctx.steps.get(record.id)) if not record.parent else "ok"
