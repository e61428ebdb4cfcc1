"""Runs a dataset's cases through a pipeline, concurrently, and checks each answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.context import RequestContext
from pipeline.events import Done
from pipeline.protocols import PipelineCaller
from pipeline.runner import Pipeline, Runner
from serving.evals.dataset import Dataset, EvalCase
from serving.evals.progress import Progress
from serving.runtime.slo import figures
from stages.checks import Answer, CheckDeps, CheckResult, evaluate


@dataclass(slots=True)
class CaseResult:
    """One case of a run: the answer, its checks, and what the request measured."""

    position: int
    case_id: str
    status: str
    passed: bool
    checks: list[dict[str, Any]]
    output: str
    ttft_ms: float | None
    itl_ms: float | None
    e2e_ms: float
    input_tokens: int
    output_tokens: int
    cost_usd: float
    request_id: str
    error: str = ""
    finish_reason: str = ""
    #: What the checks cost (judge requests), apart from the pipeline's own cost.
    eval_cost_usd: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def run_cases(runner: Runner, pipeline: Pipeline, dataset: Dataset, *, concurrency: int = 4,
                    calls: PipelineCaller | None = None, embed: Callable[[list[str]], Any] | None = None,
                    progress: Progress | None = None) -> list[CaseResult]:
    """Every case through *pipeline*, at most *concurrency* at once; results in dataset order."""
    gate = asyncio.Semaphore(max(1, concurrency))
    deps = CheckDeps(embed=embed, pipelines=calls)

    async def one(number: int, case: EvalCase) -> CaseResult:
        async with gate:
            result = await run_case(runner, pipeline, number, case, deps)
        if progress is not None:
            progress.advance(result.passed)
        return result

    try:
        return list(await asyncio.gather(*(one(number, case) for number, case in dataset.cases)))
    finally:
        if progress is not None:
            progress.close()


async def run_case(runner: Runner, pipeline: Pipeline, number: int, case: EvalCase, deps: CheckDeps) -> CaseResult:
    """One request, then its checks (run in order; a judge is one more request)."""
    ctx = RequestContext(pipeline=pipeline.name, input_messages=case.chat(), tags=dict(case.tags),
                         params=dict(case.params))
    final = await runner.run(pipeline, ctx)
    summary = final.summary
    measured = figures(summary)
    if isinstance(final, Done):
        answer = Answer(case.question, summary.output_text, tuple(ctx.documents), case.reference)
        results = [await evaluate(check, answer, deps) for check in case.checks]
        error = ""
    else:
        error = f"the request {final.status} ({final.kind}): {final.message}"
        results = [CheckResult(check.label, check.type, False, None, error=error) for check in case.checks]
    return CaseResult(
        position=number, case_id=case.id or f"line-{number}", status="ok" if isinstance(final, Done) else final.status,
        passed=all(r.passed for r in results), checks=[r.to_dict() for r in results], output=summary.output_text,
        ttft_ms=measured.ttft_ms, itl_ms=measured.itl_ms, e2e_ms=measured.e2e_ms,
        input_tokens=summary.usage.input_tokens, output_tokens=summary.usage.output_tokens,
        cost_usd=summary.cost_usd, request_id=summary.request_id, error=error, finish_reason=summary.finish_reason,
        eval_cost_usd=sum(r.cost_usd for r in results),
    )
