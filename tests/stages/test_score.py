"""The score stage: which requests are sampled, what it records, and what the loader accepts."""

from __future__ import annotations

import textwrap
import uuid

import pytest

from pipeline.context import RequestContext
from pipeline.errors import SpecError
from pipeline.loader import load_pipeline_text
from pipeline.protocols import PipelineResult, Resources
from stages.score import ScoreConfig, ScoreStage, is_sampled


class Scope:
    def __init__(self):
        self.costs, self.attributes = [], {}

    def add_cost(self, usd, kind="other", detail=""):
        self.costs.append((usd, kind))

    def set_attribute(self, key, value):
        self.attributes[key] = value


class Judge:
    async def call(self, pipeline, input, tags):
        return PipelineResult("ok", "3", 0.002, "judge-1")


def test_sampling_follows_the_request_id():
    ids = [uuid.uuid4().hex for _ in range(20000)]
    share = sum(is_sampled(i, 0.1) for i in ids) / len(ids)
    assert 0.09 < share < 0.11
    assert [is_sampled(i, 0.1) for i in ids[:50]] == [is_sampled(i, 0.1) for i in ids[:50]]
    assert all(is_sampled(i, 1.0) for i in ids[:100]) and not any(is_sampled(i, 0.0) for i in ids[:100])


async def test_a_sampled_request_is_scored_and_recorded():
    config = ScoreConfig.model_validate({"sample_rate": 1, "checks": [
        {"type": "json_schema", "schema": {"type": "object", "required": ["city"]}},
        {"type": "judge", "pipeline": "grader", "min_score": 4}]})
    stage = ScoreStage("score", config, Resources(pipelines=Judge()))
    ctx = RequestContext.from_text("extract", "Mary lives in Leeds.")
    ctx.output_text = '{"name": "Mary"}'
    scope = Scope()
    await stage.run(ctx, scope)
    scored = ctx.facts["online_eval"]
    assert scored == ctx.facts["decisions"]["score"]
    assert scored["sampled"] is True and scored["sample_rate"] == 1
    schema, judge = scored["checks"]
    assert (schema["passed"], schema["detail"]) == (False, "(root): 'city' is a required property")
    assert (judge["passed"], judge["score"], judge["judge_request_id"]) == (False, 0.6, "judge-1")
    assert scope.costs == [(0.002, "online_eval")] and scope.attributes["inferline.online_eval.passed"] is False


async def test_an_unsampled_request_only_says_so():
    config = ScoreConfig.model_validate({"sample_rate": 0, "checks": [{"type": "regex", "pattern": "."}]})
    ctx = RequestContext.from_text("chat", "hi")
    await ScoreStage("score", config, Resources()).run(ctx, Scope())
    assert ctx.facts["decisions"]["score"] == {"sampled": False} and "online_eval" not in ctx.facts


def test_the_loader_checks_a_score_stage(registry, catalog):
    text = textwrap.dedent("""
        name: scored
        stages:
          - {id: score, type: score, with: {sample_rate: 1.5, checks: [{type: contains, value: x}]}}
          - {id: prompt, type: prompt}
    """)
    with pytest.raises(SpecError) as caught:
        load_pipeline_text(text, "scored.yaml", registry, catalog)
    messages = [str(issue) for issue in caught.value.issues]
    assert any("stages[0].with.sample_rate" in m and m.startswith("scored.yaml:4:") for m in messages)
    assert any("stages[0].with.checks[0]" in m and "contains" in m for m in messages), messages
    good = textwrap.dedent("""
        name: scored
        stages:
          - {id: prompt, type: prompt}
          - {id: score, type: score, with: {sample_rate: 0.5, checks: [{type: regex, pattern: x}]}}
    """)
    with pytest.raises(SpecError, match="reads 'output_text'"):  # nothing streamed the answer before it
        load_pipeline_text(good, "scored.yaml", registry, catalog)
