"""The answer checks (stages/checks.py), one by one, with fakes for the embedder and the judge."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from pipeline.context import Document
from pipeline.protocols import PipelineResult
from stages.checks import Answer, Check, CheckDeps, cited_numbers, evaluate, normalize

CHECK = TypeAdapter(Check)
DOCS = (Document("billing-and-plans#12", "Plus costs $8.", "billing-and-plans.md", "Billing"),
        Document("refunds#3", "Refunds within 21 days.", "refunds.md", "Refunds"))


def check(**spec):
    return CHECK.validate_python(spec)


async def verdict(spec: dict, text: str, docs=DOCS, deps=None):
    return await evaluate(check(**spec), Answer("How much is Plus?", text, docs, "$8"), deps)


@pytest.mark.parametrize(("spec", "text", "passed"), [
    ({"type": "exact", "value": "Paris"}, "  Paris\n", True),
    ({"type": "exact", "value": "Paris"}, "paris", False),
    ({"type": "normalized", "value": "The Plus plan: $8!"}, "plus plan 8", True),
    ({"type": "normalized", "value": ["eight dollars", "$8"]}, "8", True),
    ({"type": "normalized", "value": "eight"}, "eight dollars", False),
    ({"type": "contains", "value": "$8 per USER"}, "It is $8   per user a month", True),
    ({"type": "contains", "value": "$8 per USER", "case_sensitive": True}, "$8 per user", False),
    ({"type": "contains", "value": ["$8", "month"], "mode": "all"}, "$8 a year", False),
    ({"type": "contains", "value": ["$8", "month"], "mode": "any"}, "$8 a year", True),
    ({"type": "regex", "pattern": r"\$\d+"}, "costs $8", True),
    ({"type": "regex", "pattern": r"\$\d+", "full": True}, "costs $8", False),
    ({"type": "regex", "pattern": "PLUS", "ignore_case": True}, "plus", True),
    ({"type": "json_schema"}, "[1, 2]", True),
    ({"type": "json_schema", "schema": {"type": "object", "required": ["price"]}}, '{"price": 8}', True),
    ({"type": "json_schema", "schema": {"type": "object", "required": ["price"]}}, '{"cost": 8}', False),
    ({"type": "json_schema"}, "```json\n{}\n```", False),
])
async def test_text_checks(spec, text, passed):
    result = await verdict(spec, text)
    assert (result.passed, result.score) == (passed, 1.0 if passed else result.score)
    assert result.name == spec["type"] and not result.error


async def test_contains_scores_the_fraction_found():
    result = await verdict({"type": "contains", "value": ["$8", "month", "user"]}, "$8 per user")
    assert not result.passed and result.score == pytest.approx(2 / 3) and result.detail == "missing ['month']"


async def test_json_schema_says_where_it_fails():
    result = await verdict({"type": "json_schema", "schema": {"type": "object", "properties": {
        "age": {"type": "integer"}}}}, '{"age": "old"}')
    assert result.detail == "age: 'old' is not of type 'integer'"
    assert (await verdict({"type": "json_schema"}, "{oops")).detail.startswith("not JSON: ")


def test_bad_specs_are_refused():
    with pytest.raises(ValidationError, match="not a valid regular expression"):
        check(type="regex", pattern="(")
    with pytest.raises(ValidationError, match="not a valid JSON Schema"):
        check(type="json_schema", schema={"type": "no-such-type"})
    with pytest.raises(ValidationError):
        check(type="contains")


def test_normalize_and_citations():
    assert normalize("  The Plus-plan, an   OFFER! ") == "plusplan offer"
    assert cited_numbers("See [2], [1, 3] and [2][4]; not [x] or [].") == [2, 1, 3, 4]


@pytest.mark.parametrize(("text", "spec", "passed", "score"), [
    ("It is $8 [1].", {"page": "billing-and-plans"}, True, 1.0),
    ("It is $8 [1].", {"page": "billing-and-plans.md"}, True, 1.0),           # the file names it too
    ("It is $8 [1][2].", {"page": "billing-and-plans"}, False, 0.5),          # one citation on another page
    ("It is $8 [1][2].", {"page": "billing-and-plans", "require": "any"}, True, 0.5),
    ("It is $8 [2].", {"page": "billing-and-plans"}, False, 0.0),
    ("It is $8 [5].", {"page": "billing-and-plans"}, False, 0.0),             # no such source
    ("It is $8.", {"page": "billing-and-plans"}, False, 0.0),                 # no citation at all
    ("Refunds [2].", {"page": ["refunds", "billing-and-plans"]}, True, 1.0),
])
async def test_citation(text, spec, passed, score):
    result = await verdict({"type": "citation", **spec}, text)
    assert (result.passed, result.score) == (passed, score)


async def test_citation_of_a_page_never_retrieved_says_so():
    result = await verdict({"type": "citation", "page": "integrations"}, "See [1].")
    assert not result.passed and not result.extra["retrieved"]
    assert result.detail == "cited [1] billing-and-plans; expected integrations (not among the sources retrieved)"


async def test_similarity_uses_the_embedder_it_is_given():
    seen = []

    def embed(texts):
        seen.append(texts)
        return [[1.0, 0.0], [0.6, 0.8]]

    result = await verdict({"type": "similarity", "reference": "$8 per user", "min_score": 0.5}, "eight",
                           deps=CheckDeps(embed=embed))
    assert result.passed and result.score == 0.6 and seen == [["eight", "$8 per user"]]
    missing = await verdict({"type": "similarity", "reference": "x"}, "y")
    assert not missing.passed and missing.score is None and "no embedding model" in missing.error


class Judges:
    def __init__(self, reply: str, status: str = "ok"):
        self.reply, self.status = reply, status
        self.calls: list[tuple[str, str, dict]] = []

    async def call(self, pipeline, input, tags):
        self.calls.append((pipeline, input, dict(tags)))
        return PipelineResult(self.status, self.reply, 0.001, "judge-req", "" if self.status == "ok" else "boom")


async def test_judge_passes_question_answer_reference_and_rubric():
    judges = Judges("4")
    result = await verdict({"type": "judge", "rubric": "Be harsh."}, "It is $8.", deps=CheckDeps(pipelines=judges))
    assert judges.calls == [("judge", "It is $8.", {"question": "How much is Plus?", "reference": "$8",
                                                    "rubric": "Be harsh."})]
    assert (result.passed, result.score, result.cost_usd) == (True, 0.8, 0.001)
    assert result.extra == {"judge_request_id": "judge-req", "grade": 4.0}


@pytest.mark.parametrize(("reply", "status", "error"), [
    ("no idea", "ok", "answered without a score"), ("", "failed", "failed: boom")])
async def test_a_judge_without_a_score_is_an_error(reply, status, error):
    result = await verdict({"type": "judge"}, "x", deps=CheckDeps(pipelines=Judges(reply, status)))
    assert not result.passed and result.score is None and error in result.error


async def test_judge_min_score_and_scale():
    deps = CheckDeps(pipelines=Judges("Score: 7"))
    result = await verdict({"type": "judge", "min_score": 8, "max_score": 10}, "x", deps=deps)
    assert (result.passed, result.score) == (False, 0.7)
