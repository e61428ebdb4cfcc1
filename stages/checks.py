"""Checks of an answer: what ``inferline eval`` asks of each dataset case, and what the ``score``
stage asks of sampled live requests.

Each check is a small pydantic model, written the same way in a dataset line and in YAML::

    {"type": "exact", "value": "Paris"}                       # the answer, stripped, is exactly this
    {"type": "normalized", "value": "the capital is Paris"}   # equal after lowercasing, dropping
                                                              #   punctuation, articles and extra spaces
    {"type": "contains", "value": ["$8", "per user"], "mode": "all"}   # substrings (case-insensitive)
    {"type": "regex", "pattern": "\\b\\d{2}:\\d{2}\\b"}      # re.search (``full: true``: fullmatch)
    {"type": "json_schema", "schema": {"type": "object", "required": ["name"]}}   # valid JSON, and valid
    {"type": "similarity", "reference": "$8 per user per month", "min_score": 0.7}   # MiniLM cosine
    {"type": "citation", "page": "billing-and-plans"}         # every [n] the answer cites is on this page
    {"type": "judge", "pipeline": "judge", "min_score": 4}    # another pipeline grades it, 1..5

Every check has an optional ``name`` (default: its type) that reports group by. A
result has ``passed`` and a ``score`` in 0..1 (1 or 0 for the yes/no checks).
``similarity`` needs an embedder and ``judge`` a :class:`~pipeline.protocols.PipelineCaller`,
both handed in by the caller (:class:`CheckDeps`); ``json_schema``, ``regex`` and
``judge`` need no reference answer (:data:`REFERENCE_FREE`), so the ``score`` stage may run them
online.
"""

from __future__ import annotations

import asyncio
import json
import re
import string
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.context import Document
from pipeline.protocols import PipelineCaller

#: Check types that need no reference answer: the ``score`` stage runs these on live traffic.
REFERENCE_FREE = frozenset({"json_schema", "regex", "judge"})
_CITATION = re.compile(r"\[(\d+(?:\s*[,;]\s*\d+)*)\]")
_SCORE = re.compile(r"-?\d+(?:\.\d+)?")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


class _Check(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    #: What reports group this check's results by (default: its type).
    name: str | None = Field(None, min_length=1, max_length=100)

    @property
    def label(self) -> str:
        return self.name or self.type  # type: ignore[attr-defined]


class ExactCheck(_Check):
    #: The check type: the answer, stripped, is exactly ``value``.
    type: Literal["exact"]
    #: The expected answer.
    value: str


class NormalizedCheck(_Check):
    #: The check type: equal after lowercasing and dropping punctuation, articles and extra spaces.
    type: Literal["normalized"]
    #: One accepted answer, or several (any of them).
    value: str | list[str]


class ContainsCheck(_Check):
    #: The check type: the answer contains ``value`` (a substring, or several).
    type: Literal["contains"]
    #: A substring, or several.
    value: str | list[str]
    #: all: every value must appear; any: one is enough.
    mode: Literal["all", "any"] = "all"
    #: Match letters' case too.
    case_sensitive: bool = False


class RegexCheck(_Check):
    #: The check type: the answer matches ``pattern``.
    type: Literal["regex"]
    #: A Python regular expression, searched for in the answer.
    pattern: str
    #: The whole answer (stripped) must match, not only a part of it.
    full: bool = False
    #: Match letters regardless of case.
    ignore_case: bool = False

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


class JsonSchemaCheck(_Check):
    #: The check type: the answer is JSON valid against ``schema``.
    type: Literal["json_schema"]
    #: The JSON Schema the answer must satisfy; {} accepts any JSON value.
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            jsonschema.validators.validator_for(value).check_schema(value)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        return value


class SimilarityCheck(_Check):
    #: The check type: the answer's meaning is close to ``reference``.
    type: Literal["similarity"]
    #: The reference answer.
    reference: str = Field(min_length=1)
    #: Cosine similarity of the two sentence embeddings (all-MiniLM-L6-v2) that passes.
    min_score: float = Field(0.7, ge=-1, le=1)


class CitationCheck(_Check):
    #: The check type: the sources the answer cites are on the expected page.
    type: Literal["citation"]
    #: The page (document id, e.g. ``billing-and-plans``, or its file) the answer must cite; or several.
    page: str | list[str]
    #: all: every cited source must be on an expected page; any: one is enough.
    require: Literal["all", "any"] = "all"


class JudgeCheck(_Check):
    #: The check type: another pipeline grades the answer.
    type: Literal["judge"]
    #: The pipeline that grades (served beside this one): it gets the answer as ``input`` and
    #: ``tags.question``, ``tags.reference``, ``tags.rubric``; the first number it answers is the score.
    pipeline: str = Field("judge", pattern=r"^[a-z][a-z0-9_-]*$")
    #: What the judge grades against (sent as ``tags.rubric``).
    rubric: str | None = None
    #: A reference answer for the judge to compare with (a dataset case's ``reference`` by default).
    reference: str | None = None
    #: The lowest grade that passes.
    min_score: float = 4.0
    #: The highest grade the judge gives (the score is grade / max_score).
    max_score: float = Field(5.0, gt=0)


Check = Annotated[ExactCheck | NormalizedCheck | ContainsCheck | RegexCheck | JsonSchemaCheck | SimilarityCheck
                  | CitationCheck | JudgeCheck, Field(discriminator="type")]
#: What the ``score`` stage accepts.
ReferenceFreeCheck = Annotated[RegexCheck | JsonSchemaCheck | JudgeCheck, Field(discriminator="type")]


@dataclass(frozen=True, slots=True)
class Answer:
    """What a check looks at: the question, the answer, and the sources the prompt numbered."""

    question: str
    text: str
    #: The documents the prompt showed as [1], [2]... (``ctx.documents`` after the prompt stage).
    documents: Sequence[Document] = ()
    #: A reference answer from the dataset (judge's default).
    reference: str | None = None


@dataclass(slots=True)
class CheckDeps:
    """What some checks need: sentence embeddings (similarity) and other pipelines (judge)."""

    embed: Callable[[list[str]], Any] | None = None
    pipelines: PipelineCaller | None = None


@dataclass(slots=True)
class CheckResult:
    name: str
    type: str
    passed: bool
    #: 0..1; None when the check could not run.
    score: float | None
    detail: str = ""
    #: Why the check could not run (a judge pipeline that failed...); a check with an error fails.
    error: str = ""
    #: What running the check cost (a judge pipeline's request).
    cost_usd: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "type": self.type, "passed": self.passed, "score": self.score}
        if self.detail:
            out["detail"] = self.detail
        if self.error:
            out["error"] = self.error
        if self.cost_usd:
            out["cost_usd"] = self.cost_usd
        return out | self.extra


async def evaluate(check: Any, answer: Answer, deps: CheckDeps | None = None) -> CheckResult:
    """Run one check on *answer*; never raises for what the answer or a judge did wrong."""
    deps = deps or CheckDeps()
    try:
        if isinstance(check, JudgeCheck):
            return await _judge(check, answer, deps)
        if isinstance(check, SimilarityCheck):
            return await _similarity(check, answer, deps)
        return _EVALUATORS[type(check)](check, answer)
    except Exception as exc:  # a broken dependency (embedder, judge) is a result, not a crash of the run
        return CheckResult(check.label, check.type, False, None, error=f"{type(exc).__name__}: {exc}")


def normalize(text: str) -> str:
    """Lowercase, no accents' compatibility forms, no punctuation, no articles, single spaces (SQuAD)."""
    text = unicodedata.normalize("NFKC", text).lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _yes(check: Any, passed: bool, detail: str = "") -> CheckResult:
    return CheckResult(check.label, check.type, passed, 1.0 if passed else 0.0, detail)


def _exact(check: ExactCheck, answer: Answer) -> CheckResult:
    return _yes(check, answer.text.strip() == check.value.strip())


def _normalized(check: NormalizedCheck, answer: Answer) -> CheckResult:
    accepted = [check.value] if isinstance(check.value, str) else check.value
    got = normalize(answer.text)
    return _yes(check, any(got == normalize(value) for value in accepted), f"normalized answer: {got[:80]!r}")


def _contains(check: ContainsCheck, answer: Answer) -> CheckResult:
    values = [check.value] if isinstance(check.value, str) else check.value

    def fold(text: str) -> str:
        text = " ".join(unicodedata.normalize("NFKC", text).split())
        return text if check.case_sensitive else text.casefold()

    text = fold(answer.text)
    found = [value for value in values if fold(value) in text]
    missing = [value for value in values if value not in found]
    passed = bool(found) if check.mode == "any" else not missing
    score = len(found) / len(values) if values else 1.0
    return CheckResult(check.label, check.type, passed, 1.0 if passed and check.mode == "any" else score,
                       f"missing {missing}" if missing else "")


def _regex(check: RegexCheck, answer: Answer) -> CheckResult:
    flags = re.IGNORECASE if check.ignore_case else 0
    text = answer.text.strip()
    match = re.fullmatch(check.pattern, text, flags) if check.full else re.search(check.pattern, text, flags)
    return _yes(check, match is not None)


def _json_schema(check: JsonSchemaCheck, answer: Answer) -> CheckResult:
    try:
        value = json.loads(answer.text)
    except json.JSONDecodeError as exc:
        return _yes(check, False, f"not JSON: {exc.msg} at character {exc.pos}")
    error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(check.schema_)(
        check.schema_).iter_errors(value))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return _yes(check, False, f"{where}: {error.message}")
    return _yes(check, True)


def cited_numbers(text: str) -> list[int]:
    """The source numbers an answer cites, in order of first mention: ``[1]``, ``[2, 3]``, ``[1][4]``."""
    numbers: list[int] = []
    for group in _CITATION.findall(text):
        for part in re.split(r"[,;]", group):
            number = int(part)
            if number not in numbers:
                numbers.append(number)
    return numbers


def page_of(document: Document) -> set[str]:
    """The names a document's page goes by: its document id (chunk id without ``#n``), its file and stem."""
    names = {document.id.rsplit("#", 1)[0]}
    if document.source:
        names |= {document.source, document.source.rsplit(".", 1)[0]}
    return names


def _citation(check: CitationCheck, answer: Answer) -> CheckResult:
    expected = {check.page} if isinstance(check.page, str) else set(check.page)
    docs = list(answer.documents)
    retrieved = any(page_of(doc) & expected for doc in docs)
    cited = cited_numbers(answer.text)
    extra = {"cited": cited, "retrieved": retrieved}
    if not cited:
        return CheckResult(check.label, check.type, False, 0.0, "the answer cites no source", extra=extra)
    pages = [sorted(page_of(docs[n - 1]))[0] if 1 <= n <= len(docs) else None for n in cited]
    right = [p is not None and bool(page_of(docs[n - 1]) & expected) for n, p in zip(cited, pages, strict=True)]
    passed = all(right) if check.require == "all" else any(right)
    shown = ", ".join(f"[{n}] {p or 'no such source'}" for n, p in zip(cited, pages, strict=True))
    detail = f"cited {shown}; expected {', '.join(sorted(expected))}"
    if not retrieved:
        detail += " (not among the sources retrieved)"
    return CheckResult(check.label, check.type, passed, sum(right) / len(right), detail,
                       extra=extra | {"cited_pages": pages})


async def _similarity(check: SimilarityCheck, answer: Answer, deps: CheckDeps) -> CheckResult:
    if deps.embed is None:
        raise RuntimeError("no embedding model was given for similarity checks")
    vectors = await asyncio.to_thread(deps.embed, [answer.text, check.reference])
    score = float(sum(a * b for a, b in zip(vectors[0], vectors[1], strict=True)))
    return CheckResult(check.label, check.type, score >= check.min_score, round(score, 4),
                       f"cosine {score:.3f} (pass at {check.min_score:g})")


async def _judge(check: JudgeCheck, answer: Answer, deps: CheckDeps) -> CheckResult:
    if deps.pipelines is None:
        raise RuntimeError("no pipelines are reachable here to run a judge")
    reference = check.reference if check.reference is not None else answer.reference
    tags = {"question": answer.question, "reference": reference or "", "rubric": check.rubric or ""}
    result = await deps.pipelines.call(check.pipeline, answer.text, tags)
    base = {"judge_request_id": result.request_id}
    if result.status != "ok":
        return CheckResult(check.label, check.type, False, None, error=f"judge pipeline {check.pipeline!r} "
                           f"{result.status}: {result.error}", cost_usd=result.cost_usd, extra=base)
    match = _SCORE.search(result.output_text)
    if match is None:
        return CheckResult(check.label, check.type, False, None, error=f"judge pipeline {check.pipeline!r} "
                           "answered without a score", cost_usd=result.cost_usd, extra=base)
    grade = float(match.group())
    score = min(1.0, max(0.0, grade / check.max_score))
    return CheckResult(check.label, check.type, grade >= check.min_score, round(score, 4),
                       f"judge gave {grade:g}/{check.max_score:g} (pass at {check.min_score:g})",
                       cost_usd=result.cost_usd, extra=base | {"grade": grade})


_EVALUATORS: dict[type, Callable[[Any, Answer], CheckResult]] = {
    ExactCheck: _exact, NormalizedCheck: _normalized, ContainsCheck: _contains, RegexCheck: _regex,
    JsonSchemaCheck: _json_schema, CitationCheck: _citation,
}
