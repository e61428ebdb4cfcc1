"""Replay by step: the outputs an audit record kept, reused where the candidate's step is the same, and each
step's run compared, old against new (serving/evals/replay.py runs the requests).

    ctx.reuse = reusable(record)                 # what a replay may reuse, by step key (content: full only)
    steps = compare_steps(record, ctx.stages)    # per step: reused, rerun or skipped; old against new
    reuse = reuse_summary(steps, full=False)     # how many reused and rerun, and what reusing saved
    changes = step_changes(pipeline, record)     # a record that keeps no values: which steps a candidate changed

A step is reused when the candidate's step has the definition the record names (``definition_sha256``) and
reads what the record says it read (``inputs_sha256``): the runner checks both (pipeline/steps.py), so a step
after a changed one reruns only where what it reads changed. Only a step type that declares its outputs
(``llm``, ``reply``, ``pipeline``, ``split``) can be reused; a chain's stages and the audit step always run.
What reusing saved is what the record says each reused step cost: its tokens, its cost and its time (step
time: steps that ran side by side overlap, so it can exceed the request's).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from difflib import SequenceMatcher
from typing import TYPE_CHECKING, Any

from pipeline.context import Reusable, StageRecord, step_key

if TYPE_CHECKING:  # the report imports this module, and the command line the report, before any pipeline runs
    from pipeline.runner import Pipeline

#: What a record that keeps no step values could not do, by its content mode.
NOT_REUSED = {
    "hash": "the record keeps its steps' hashes only (content: hash): it tells which steps the candidate "
            "changed, but their outputs cannot be reused, nor the request sent again",
    "redacted": "the record keeps only its steps' definitions (content: redacted): it tells which steps the "
                "candidate changed, but their outputs cannot be reused, nor the request sent again",
    "encrypted": "the record keeps only its steps' definitions (content: encrypted): it tells which steps the "
                 "candidate changed, but their outputs cannot be reused, nor the request sent again",
}
#: Words of context kept around each change in a short diff, and its length at most (characters).
CONTEXT_WORDS, DIFF_CHARS = 4, 240
_SIDE_SUMS = ("input_tokens", "output_tokens", "cost_usd", "duration_ms")


def _runs(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """A record's top-level step rows (not a sub-pipeline's) by step key, each key's attempts in order."""
    found: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        step = row.get("step")
        if isinstance(step, dict) and not step.get("parent"):
            found.setdefault(step_key(str(row["stage_id"]), step.get("item"), int(step.get("round") or 0)),
                             []).append(row)
    return found


def reusable(record: Mapping[str, Any]) -> dict[str, Reusable]:
    """The outputs a replay of *record* may reuse (``RequestContext.reuse``): each step's last attempt that
    ended ok, where the record keeps its output and the hashes of its definition and inputs."""
    found: dict[str, Reusable] = {}
    for key, rows in _runs(record.get("stages") or ()).items():
        ok = [row["step"] for row in rows if row.get("status") == "ok"]
        step = ok[-1] if ok else {}
        if isinstance(step.get("output"), dict) and step.get("definition_sha256") and step.get("inputs_sha256"):
            found[key] = Reusable(step["definition_sha256"], step["inputs_sha256"], step["output"])
    return found


def _old_side(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    last = rows[-1]["step"]
    side = {"status": rows[-1].get("status"), "attempts": len(rows), "reused": bool(last.get("reused")),
            "input_tokens": sum(int(r["step"].get("input_tokens") or 0) for r in rows),
            "output_tokens": sum(int(r["step"].get("output_tokens") or 0) for r in rows),
            "cost_usd": round(sum(float(r.get("cost_usd") or 0.0) for r in rows), 9),
            "duration_ms": round(sum(float(r.get("duration_ms") or 0.0) for r in rows), 3)}
    return side | {"output": shown(last.get("output")), "output_sha256": last.get("output_sha256")}


def _new_side(records: Sequence[StageRecord]) -> dict[str, Any]:
    last = records[-1]
    side = {"status": last.status, "attempts": len(records), "reused": last.reused,
            "input_tokens": sum(r.input_tokens for r in records),
            "output_tokens": sum(r.output_tokens for r in records),
            "cost_usd": round(sum(r.cost_usd for r in records), 9),
            "duration_ms": round(sum(r.duration_s for r in records) * 1e3, 3)}
    return side | {"output": shown(last.output), "output_sha256": last.output_sha256 or None}


def shown(output: Any) -> str | None:
    """A step's output as the comparison shows it: its ``output`` (the text, or the object a JSON Schema
    types, as JSON), else its ``text``, else all its outputs as JSON; None when not kept."""
    if not isinstance(output, dict):
        return None
    value = output.get("output", output.get("text", output))
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def compare_steps(record: Mapping[str, Any], stages: Sequence[StageRecord]) -> list[dict[str, Any]]:
    """Each step of the replay (*stages*: its context's records) against the same step in *record*, in the
    order the replay ran them, then the recorded steps it did not run: how it ran (``reused``, ``rerun``,
    ``skipped``, or ``removed``: not in the candidate), whether its output is the same, a short diff, and
    each side's status, attempts, tokens, cost, time and output."""
    old = _runs(record.get("stages") or ())
    new: dict[str, list[StageRecord]] = {}
    for stage in stages:
        if not stage.parent:
            new.setdefault(stage.key, []).append(stage)
    compared = []
    for key in [*new, *(key for key in old if key not in new)]:
        before = _old_side(old[key]) if key in old else None
        after = _new_side(new[key]) if key in new else None
        run = "removed" if after is None else "skipped" if after["status"] == "skipped" else \
            "reused" if after["reused"] else "rerun"
        old_text, new_text = (before or {}).get("output"), (after or {}).get("output")
        same = None if old_text is None or new_text is None else old_text == new_text
        compared.append({"step": key, "type": (new[key][-1].type if key in new else old[key][-1].get("type")),
                         "run": run, "identical": same,
                         "diff": short_diff(old_text, new_text) if same is False else "", "old": before, "new": after})
    return compared


def reuse_summary(steps: Sequence[Mapping[str, Any]], *, full: bool) -> dict[str, Any]:
    """How a replay ran *steps*: by step (reusing what it could) or ``full``; how many steps were reused, rerun
    and skipped; and what reusing saved, as the record says the reused steps cost."""
    reused = [s for s in steps if s["run"] == "reused" and s["old"] is not None]
    return {"mode": "full" if full else "step", **{run: sum(s["run"] == run for s in steps)
                                                   for run in ("reused", "rerun", "skipped")},
            "saved": {name: round(sum(s["old"][name] for s in reused), 9 if name == "cost_usd" else 3)
                      for name in _SIDE_SUMS}}


def step_changes(pipeline: Pipeline, record: Mapping[str, Any]) -> dict[str, Any] | None:
    """Which steps of *pipeline* (the candidate) differ from those that served *record*, by the SHA-256 of
    each step's definition: ``changed`` (a different definition), ``added`` (no such step in the record),
    ``removed`` (not in the candidate), ``after`` (steps after a changed or added one: they rerun where what
    they read changed), ``unchanged``, and ``not_run`` (the record skipped them: no definition to compare).
    None when the record keeps no step definitions (older records). The audit step that wrote the record is
    not in it, and is not listed."""
    kept: dict[str, str] = {}
    for rows in _runs(record.get("stages") or ()).values():  # every item and round of a step has its definition
        step_id = str(rows[0]["stage_id"])
        kept[step_id] = kept.get(step_id) or next((str(row["step"]["definition_sha256"]) for row in rows
                                                   if row["step"].get("definition_sha256")), "")
    if not any(kept.values()):
        return None
    ours = {bound.plan.spec.id: bound for bound in pipeline.stages}
    changed = [step for step, bound in ours.items() if kept.get(step) and kept[step] != bound.definition_sha256]
    added = [step for step, bound in ours.items() if step not in kept and not bound.plan.cls.records_steps]
    moved = set(changed) | set(added)
    after = [step for step in pipeline.graph.order if step not in moved and moved & pipeline.graph.ancestors[step]
             and not ours[step].plan.cls.records_steps]
    unchanged = [step for step, bound in ours.items() if kept.get(step) == bound.definition_sha256]
    return {"changed": changed, "added": added, "removed": [step for step in kept if step not in ours],
            "after": after, "unchanged": [step for step in unchanged if step not in after],
            "not_run": [step for step in ours if step in kept and not kept[step] and step not in after]}


def diff_parts(old: str, new: str) -> list[tuple[str, str]]:
    """*old* against *new* word by word: ``("=", words)`` kept, ``("-", words)`` removed, ``("+", words)``
    added, ``("…", "")`` where unchanged words were left out (more than :data:`CONTEXT_WORDS` from a change)."""
    a, b = old.split(), new.split()
    parts: list[tuple[str, str]] = []
    codes = SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    for n, (tag, i1, i2, j1, j2) in enumerate(codes):
        if tag != "equal":
            if i2 > i1:
                parts.append(("-", " ".join(a[i1:i2])))
            if j2 > j1:
                parts.append(("+", " ".join(b[j1:j2])))
            continue
        words = a[i1:i2]
        head = words[:CONTEXT_WORDS] if n else []  # after a change: the words that follow it
        tail = words[-CONTEXT_WORDS:] if n < len(codes) - 1 else []  # before a change: the words that lead to it
        if len(words) <= len(head) + len(tail):
            parts.append(("=", " ".join(words)))
            continue
        parts += [("=", " ".join(head))] if head else []
        parts.append(("…", ""))
        parts += [("=", " ".join(tail))] if tail else []
    return parts


def short_diff(old: str, new: str) -> str:
    """*old* against *new* as one line, as ``git diff --word-diff`` marks it: ``[-removed-]{+added+}``, with a
    few words of context around each change, cut at :data:`DIFF_CHARS` characters."""
    if old == new:
        return ""
    if old.split() == new.split():
        return "(only the spacing differs)"
    marks = {"=": "{}", "-": "[-{}-]", "+": "{{+{}+}}", "…": "…"}
    text = " ".join(marks[op].format(words) for op, words in diff_parts(old, new))
    return text if len(text) <= DIFF_CHARS else text[:DIFF_CHARS - 1] + "…"
