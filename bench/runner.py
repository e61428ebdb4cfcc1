"""Runner overhead: seven no-op stages through the runner (tracing on) vs. called directly.

    .venv/bin/python bench/runner.py [--requests N] [--repeats R]

Both are measured in the same run, interleaved, and the best of R repeats is
kept for each (these machines are noisy). The last line is one JSON object
with ``overhead_us_per_stage`` and ``overhead_ms_per_request``. Targets: under
50 µs per stage and under 1 ms per request.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds http.py, which would shadow the standard library's http
# package (imported by torch, httpx...) for any script run from here.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import asyncio
import json
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from pipeline.context import RequestContext
from pipeline.loader import load_pipeline_text
from pipeline.registry import StageRegistry
from pipeline.runner import Pipeline, Runner
from pipeline.stage import Stage
from pipeline.tracing import make_tracer_provider

NUM_STAGES = 7


class NoOp(Stage):
    type_name = "noop"

    async def run(self, ctx, scope) -> None:
        return None


class _Discard(SpanExporter):
    """Exports to nowhere, so the figure is the runner's and the SDK's, not a sink's."""

    def export(self, spans) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class _NullScope:
    async def emit_text(self, text: str, index: int = 0, logprobs: tuple = ()) -> None: ...

    def add_cost(self, usd: float, kind: str = "other", detail: str = "") -> None: ...

    def set_attribute(self, key: str, value: object) -> None: ...


def _pipeline() -> Pipeline:
    registry = StageRegistry()
    registry.register(NoOp)
    stages = "\n".join(f"  - {{id: s{i}, type: noop}}" for i in range(NUM_STAGES))
    return Pipeline(load_pipeline_text(f"name: bench\nstages:\n{stages}\n", "bench.yaml", registry))


async def _direct(stages: Sequence[Stage], requests: int) -> float:
    scope = _NullScope()
    start = time.perf_counter()
    for _ in range(requests):
        ctx = RequestContext.from_text("bench", "hi")
        for stage in stages:
            await stage.run(ctx, scope)
    return (time.perf_counter() - start) / requests


async def _runner(runner: Runner, pipeline: Pipeline, requests: int) -> float:
    start = time.perf_counter()
    for _ in range(requests):
        async for _event in runner.stream(pipeline, RequestContext.from_text("bench", "hi")):
            pass
    return (time.perf_counter() - start) / requests


async def main(requests: int, repeats: int) -> dict[str, float]:
    provider = make_tracer_provider("none")
    provider.add_span_processor(BatchSpanProcessor(_Discard(), max_queue_size=100_000))
    runner, pipeline = Runner(provider.get_tracer("bench")), _pipeline()
    stages = [bound.stage for bound in pipeline.stages]
    await _runner(runner, pipeline, 200)  # warm up
    direct, ours = [], []
    for _ in range(repeats):
        direct.append(await _direct(stages, requests))
        ours.append(await _runner(runner, pipeline, requests))
    provider.shutdown()
    baseline_s, runner_s = min(direct), min(ours)
    overhead_s = runner_s - baseline_s
    return {
        "stages": NUM_STAGES,
        "requests": requests * repeats,
        "direct_us_per_request": round(baseline_s * 1e6, 2),
        "runner_us_per_request": round(runner_s * 1e6, 2),
        "ratio": round(runner_s / baseline_s, 1),
        "overhead_us_per_stage": round(overhead_s * 1e6 / NUM_STAGES, 2),
        "overhead_ms_per_request": round(overhead_s * 1e3, 4),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per repeat (default 2000)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats; the best is kept (default 5)")
    args = parser.parse_args()
    result = asyncio.run(main(args.requests, args.repeats))
    print(f"direct {result['direct_us_per_request']} µs/request, runner {result['runner_us_per_request']} µs/request")
    print(json.dumps(result))
