"""The ``score`` stage: online evaluation of a sample of live requests.

YAML (after ``stream``, before ``audit``)::

    - id: score
      type: score
      with:
        sample_rate: 0.05          # the fraction of requests scored (0..1)
        checks:                    # checks that need no reference answer (stages/checks.py)
          - {type: json_schema, schema: {type: object, required: [name]}}
          - {type: judge, pipeline: judge, min_score: 4}

Whether a request is sampled follows from its request id (the first 64 bits of its
SHA-256 against ``sample_rate``), so the choice is reproducible from the audit log.
A sampled request's results go to ``ctx.facts["online_eval"]`` (the server counts them
in ``inferline_online_eval_*`` metrics) and, as this stage's decision, into the request's
audit record, which is hash-chained like every other field. A judge is a request to
another pipeline of this process: its cost is added to this stage's, and its own audit
record (if the judge pipeline has an audit stage) carries the ``judge_request_id`` that
this record names. A sampled request waits for its judge before its final event (streamed
text has already reached the client). A check that cannot run is recorded as an error;
it never fails the request.
"""

from __future__ import annotations

import hashlib
from typing import cast

from pydantic import BaseModel, Field

from pipeline.context import RequestContext
from pipeline.stage import NoConfig, Stage, StageScope
from stages.checks import Answer, CheckDeps, JudgeCheck, ReferenceFreeCheck, evaluate


class ScoreConfig(NoConfig):
    #: The fraction of requests scored (0..1), chosen by request id.
    sample_rate: float = Field(ge=0, le=1)
    #: Checks that need no reference answer: json_schema, regex, judge.
    checks: list[ReferenceFreeCheck] = Field(min_length=1)


def is_sampled(request_id: str, rate: float) -> bool:
    """Whether *request_id* falls in a sample of *rate*: the same answer every time it is asked."""
    if rate >= 1:
        return True
    draw = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") / 2 ** 64
    return draw < rate


class ScoreStage(Stage):
    """Runs the reference-free checks on a sample of requests; records what they found."""

    type_name = "score"
    Config = ScoreConfig
    reads = frozenset({"output_text"})

    @classmethod
    def calls(cls, config: BaseModel) -> list[tuple[tuple[str | int, ...], str]]:
        return [(("checks", n, "pipeline"), check.pipeline) for n, check in enumerate(cast(ScoreConfig, config).checks)
                if isinstance(check, JudgeCheck)]

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        config = cast(ScoreConfig, self.config)
        if not is_sampled(ctx.request_id, config.sample_rate):
            ctx.facts.setdefault("decisions", {})[self.id] = {"sampled": False}
            return
        answer = Answer(ctx.input, ctx.output_text, tuple(ctx.documents))
        deps = CheckDeps(pipelines=self.resources.pipelines)
        results = [await evaluate(check, answer, deps) for check in config.checks]
        for result in results:
            if result.cost_usd:
                scope.add_cost(result.cost_usd, "online_eval", f"{result.name}: judge request")
        scored = {"sampled": True, "sample_rate": config.sample_rate, "checks": [r.to_dict() for r in results]}
        ctx.facts["online_eval"] = scored
        ctx.facts.setdefault("decisions", {})[self.id] = scored
        scope.set_attribute("inferline.online_eval.passed", all(r.passed for r in results))
