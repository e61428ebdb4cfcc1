"""Shadow traffic: a share of a pipeline's requests also runs on a candidate version, never answered.

    PUT /pipelines/support/shadow {"version": "4", "percent": 10}     (inferline pipelines shadow support 4 10)

Once a request has its answer (or its error), :meth:`Shadows.mirror` picks it, by its request id, with
the shadow's ``percent``, and runs the same input (messages, parameters, tags, caller) on the candidate
version in the background: the caller's answer is never held up or changed, and the shadow's output
goes nowhere but the comparison. A shadow run uses up no caller's rate limit or budget and skips the
response cache (it measures the candidate's own answer). At most ``max_in_flight`` shadows run at
once; a request picked beyond that is not mirrored, and counted so.

What is recorded, old (the version that served) against new (the candidate):
- metrics: ``inferline_shadow_runs_total{pipeline, candidate, output}`` (identical, different, failed,
  dropped), ``inferline_shadow_policy_total{pipeline, candidate, decision}`` (same, different),
  ``inferline_shadow_duration_seconds{pipeline, side}``, ``inferline_shadow_output_tokens_total`` and
  ``inferline_shadow_cost_usd_total`` by ``side`` (served, shadow), and, step by step (a workflow's steps,
  a chain's stages), ``inferline_shadow_steps_differing_total{pipeline, candidate, step}``: the shadow runs
  in which the step gave something else than in the served run (any of its items or rounds; one that ran
  on one side only counts too), so that a team sees which step a candidate changes
  (pipeline/step_results.py);
- audit: the candidate's own audit stage writes the shadow run's record (its version, output,
  latency, tokens, cost and policy decision, in the candidate's ``content:`` mode), with one more stage
  row, ``shadow``, naming the request it mirrors and that request as served, and which runs of steps
  differ from it (``steps_differing``; stages/audit.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

from prometheus_client import CollectorRegistry, Counter, Histogram

from pipeline.context import RequestContext
from pipeline.events import Done, Error
from pipeline.runner import Pipeline, Runner
from pipeline.step_results import differing_steps, step_of, step_results
from serving.runtime.deployments import Deployments
from stages.audit import strongest_action

logger = logging.getLogger(__name__)

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Shadows:
    """Mirrors picked requests onto their pipeline's shadow candidate (``deployments.shadows``), run by *runner*."""

    def __init__(self, deployments: Deployments, runner: Runner, *, registry: CollectorRegistry | None = None,
                 max_in_flight: int = 8):
        self.deployments = deployments
        self.runner = runner
        self.max_in_flight = max_in_flight
        self._tasks: set[asyncio.Task[None]] = set()
        self.runs = Counter("inferline_shadow_runs", "Shadow runs on a candidate version, by how its output "
                            "compared with the answer served (identical, different, failed, dropped).",
                            ["pipeline", "candidate", "output"], registry=registry)
        self.policy = Counter("inferline_shadow_policy", "Shadow runs by whether the candidate's policy "
                              "decision was the served one's (same, different).",
                              ["pipeline", "candidate", "decision"], registry=registry)
        self.duration = Histogram("inferline_shadow_duration_seconds", "End-to-end latency of mirrored "
                                  "requests, the served one and its shadow.", ["pipeline", "side"],
                                  buckets=_BUCKETS, registry=registry)
        self.tokens = Counter("inferline_shadow_output_tokens", "Output tokens of mirrored requests, the "
                              "served one and its shadow.", ["pipeline", "side"], registry=registry)
        self.cost = Counter("inferline_shadow_cost_usd", "Cost of mirrored requests, the served one and its "
                            "shadow, in USD.", ["pipeline", "side"], registry=registry)
        self.steps = Counter("inferline_shadow_steps_differing", "Shadow runs in which a step's output (or "
                             "status) was not the served run's, by step.", ["pipeline", "candidate", "step"],
                             registry=registry)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def mirror(self, pipeline: Pipeline, ctx: RequestContext, final: Done | Error) -> bool:
        """Run *ctx*'s request again on its pipeline's shadow candidate when the request is picked; True
        if a shadow run was started."""
        if ctx.shadow_of:
            return False  # no shadow of a shadow
        candidate = self.deployments.shadow_choice(ctx.pipeline, ctx.request_id)
        if candidate is None or candidate == pipeline.loaded.sha256:
            return False
        if len(self._tasks) >= self.max_in_flight:
            self.runs.labels(ctx.pipeline, candidate[:12], "dropped").inc()
            return False
        task = asyncio.create_task(self._run(ctx, final, candidate))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the shadow runs in flight (at shutdown, and in tests); True when none is left."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        return not self._tasks

    async def aclose(self, timeout_s: float) -> None:
        """Let the shadow runs finish for up to *timeout_s*, then cancel the rest."""
        if not await self.wait(timeout_s):
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, served: RequestContext, final: Done | Error, candidate: str) -> None:
        name, summary = served.pipeline, final.summary
        label = candidate[:12]
        try:
            pipeline = await self.deployments.pinned(name, candidate)
            if pipeline is None:
                raise LookupError(f"version {candidate[:12]} is not kept")
            label = pipeline.spec.version or label
            shadow = RequestContext(
                pipeline=name, input_messages=list(served.input_messages), principal=served.principal,
                tags=dict(served.tags), params=dict(served.params), stop=list(served.stop),
                tools=list(served.tools), tool_choice=served.tool_choice, client_addr=served.client_addr,
                shadow_of=served.request_id)
            if "input_texts" in served.facts:  # an embeddings request: its audit content is the texts sent
                shadow.facts["input_texts"] = list(served.facts["input_texts"])
            served_policy, served_steps = _strongest(served), step_results(served)
            shadow.facts["shadow"] = {
                "version": summary.pipeline_version, "spec_sha256": summary.spec_sha256,
                "status": "ok" if isinstance(final, Done) else final.status,
                "output_sha256": hashlib.sha256(summary.output_text.encode()).hexdigest(),
                "duration_ms": round(summary.duration_s * 1e3, 3),
                "ttft_ms": None if summary.ttft_s is None else round(summary.ttft_s * 1e3, 3),
                "output_tokens": summary.usage.output_tokens, "cost_usd": summary.cost_usd,
                "policy_action": served_policy, "steps": served_steps}
            result = await self.runner.run(pipeline, shadow)
        except Exception as exc:  # a shadow must never take anything down with it
            logger.warning("shadow of %s on %s failed (%s: %s)", name, label, type(exc).__name__, exc)
            self.runs.labels(name, label, "failed").inc()
            return
        mirrored = result.summary
        if isinstance(result, Error) and isinstance(final, Done):
            output = "failed"
        else:
            output = "identical" if mirrored.output_text == summary.output_text else "different"
        self.runs.labels(name, label, output).inc()
        self.policy.labels(name, label, "same" if _strongest(shadow) == served_policy else "different").inc()
        for step in dict.fromkeys(step_of(run) for run in differing_steps(served_steps, step_results(shadow))):
            self.steps.labels(name, label, step).inc()
        for side, figures in (("served", summary), ("shadow", mirrored)):
            self.duration.labels(name, side).observe(figures.duration_s)
            self.tokens.labels(name, side).inc(figures.usage.output_tokens)
            self.cost.labels(name, side).inc(figures.cost_usd)


def _strongest(ctx: RequestContext) -> str | None:
    return strongest_action(list(ctx.facts.get("policy", [])))
