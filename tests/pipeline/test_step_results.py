"""step_results names each run of a step (item, round, sub-pipeline) and compares what it gave: the recorded
output's hash, else the step's last outputs, else its status; differing_steps finds the runs that differ."""

from __future__ import annotations

from pipeline.context import RequestContext, StageRecord
from pipeline.step_results import differing_steps, step_of, step_results


def _ctx(*records: StageRecord, **steps: dict) -> RequestContext:
    ctx = RequestContext.from_text("p", "hi")
    ctx.stages.extend(records)
    ctx.steps.update(steps)
    return ctx


def test_runs_are_named_by_parent_item_and_round_and_their_last_attempt_counts():
    ctx = _ctx(StageRecord("split", "split", "ok", output_sha256="a"),
               StageRecord("sum", "llm", "ok", item=0, output_sha256="b"),
               StageRecord("sum", "llm", "ok", item=1, output_sha256="c"),
               StageRecord("draft", "llm", "failed", round=2),
               StageRecord("draft", "llm", "ok", round=2, attempt=2, output_sha256="d"),
               StageRecord("answer", "llm", "skipped", parent="call", skip_reason="when"),
               StageRecord("log", "audit", "ok"))
    assert step_results(ctx) == {"split": "a", "sum[0]": "b", "sum[1]": "c", "draft@2": "d",
                                 "call/answer": "skipped:when"}
    assert [step_of(name) for name in step_results(ctx)] == ["split", "sum", "sum", "draft", "call/answer"]


def test_without_recorded_outputs_a_step_compares_by_its_last_outputs():
    old = _ctx(StageRecord("gen", "generate", "ok"), gen={"status": "ok", "output_text": "Paris."})
    same = _ctx(StageRecord("gen", "generate", "ok"), gen={"status": "ok", "output_text": "Paris."})
    other = _ctx(StageRecord("gen", "generate", "ok"), gen={"status": "ok", "output_text": "Par"})
    assert differing_steps(step_results(old), step_results(same)) == []
    assert differing_steps(step_results(old), step_results(other)) == ["gen"]


def test_a_run_on_one_side_only_differs():
    old = {"draft": "a", "accepted": "b", "redraft": "skipped:when"}
    new = {"draft": "a", "accepted": "skipped:when", "redraft": "c", "extra": "d"}
    assert differing_steps(old, new) == ["accepted", "redraft", "extra"]
    assert differing_steps({"gone": "a"}, {}) == ["gone"]
