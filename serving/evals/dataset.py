"""Evaluation datasets: JSON Lines, one case per line, each with what to check.

    {"id": "plus-price", "input": "How much does the Plus plan cost?", "reference": "$8 per user per month",
     "checks": [{"type": "contains", "value": "$8"}, {"type": "citation", "page": "billing-and-plans"}]}

A case has ``input`` (one user message) or ``messages`` (a chat), and optionally ``id``
(default ``line-N``; ids must be unique: baselines compare cases by id), ``tags`` and
``params`` (sampling overrides the pipeline lets callers set), ``reference`` (a reference
answer the judge sees) and ``checks`` (stages/checks.py). Blank lines and lines starting
with ``#`` are skipped. Every bad line is reported, as ``FILE:LINE:COL: where: what``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from pipeline.diagnostics import suggest
from pipeline.errors import SpecError, SpecIssue
from serving.http.schemas import ChatInput
from stages.checks import Check

_CHECK_TYPES = frozenset({"exact", "normalized", "contains", "regex", "json_schema", "similarity", "citation",
                          "judge"})


class EvalCase(ChatInput):
    """One line of a dataset."""

    id: str | None = Field(None, min_length=1, max_length=200)
    tags: dict[str, str] = Field(default_factory=dict)
    params: dict[str, Any] = Field(default_factory=dict)
    reference: str | None = None
    checks: list[Check] = Field(min_length=1)

    @property
    def question(self) -> str:
        """The last user message: what a judge is told was asked."""
        return next(m.content for m in reversed(self.chat()) if m.role == "user")


@dataclass(frozen=True, slots=True)
class Dataset:
    file: str
    sha256: str
    #: (line number, case), in file order; every case has an id.
    cases: tuple[tuple[int, EvalCase], ...]


def load_dataset(path: str | Path) -> Dataset:
    """Read and validate a dataset; raises :class:`SpecError` with every bad line."""
    file = str(path)
    data = Path(path).read_bytes()
    issues: list[SpecIssue] = []
    cases: list[tuple[int, EvalCase]] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        case = _case(file, number, line, issues)
        if case is None:
            continue
        case_id = case.id or f"line-{number}"
        if case_id in seen:
            issues.append(SpecIssue(file, number, _col(line, "id"), "id", f"duplicate case id {case_id!r} (first "
                                    f"used on line {seen[case_id]}); ids must be unique"))
            continue
        seen[case_id] = number
        cases.append((number, case.model_copy(update={"id": case_id})))
    if not cases and not issues:
        issues.append(SpecIssue(file, 1, 1, "", "the dataset has no cases (one JSON object per line)"))
    if issues:
        raise SpecError(issues)
    return Dataset(file, hashlib.sha256(data).hexdigest(), tuple(cases))


def _case(file: str, number: int, line: str, issues: list[SpecIssue]) -> EvalCase | None:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        issues.append(SpecIssue(file, number, exc.colno, "", f"not valid JSON: {exc.msg}"))
        return None
    if not isinstance(raw, dict):
        issues.append(SpecIssue(file, number, 1, "", f"expected a JSON object, got {type(raw).__name__}"))
        return None
    try:
        return EvalCase.model_validate(raw)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            loc = _loc(error["loc"])
            key = next((str(p) for p in reversed(loc) if isinstance(p, str)), "")
            issues.append(SpecIssue(file, number, _col(line, key), _format(loc), _message(error, loc)))
        return None


def _loc(loc: tuple[Any, ...]) -> tuple[str | int, ...]:
    # A discriminated union puts the tag in the path (checks.0.exact.value): leave it out.
    return tuple(p for i, p in enumerate(loc) if not (p in _CHECK_TYPES and i and isinstance(loc[i - 1], int)))


def _format(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(error: dict[str, Any], loc: tuple[str | int, ...]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        allowed = sorted(EvalCase.model_fields) if len(loc) == 1 else []
        return f"unknown key {loc[-1]!r}{suggest(str(loc[-1]), allowed)}"
    if kind == "missing":
        return f"missing required key {loc[-1]!r}" if loc else "missing required keys"
    if kind == "union_tag_invalid":
        tag = error.get("ctx", {}).get("tag", "")
        types = ", ".join(sorted(_CHECK_TYPES))
        return f"unknown check type {tag!r}{suggest(tag, sorted(_CHECK_TYPES))} (types: {types})"
    if kind == "union_tag_not_found":
        return f"a check needs 'type' (one of {', '.join(sorted(_CHECK_TYPES))})"
    message = str(error["msg"])
    return message.removeprefix("Value error, ")


def _col(line: str, key: str) -> int:
    """The column of ``"key"`` in *line* (1 if absent)."""
    index = line.find(f'"{key}"') if key else -1
    return index + 1 if index >= 0 else 1
