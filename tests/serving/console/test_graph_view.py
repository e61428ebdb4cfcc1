"""The pipeline page's graph drawing: layers by depth, an arrow per need, fallbacks beside, loops back."""

from __future__ import annotations

from pipeline.loader import load_pipeline_text
from serving.console.graph_view import BOX_HEIGHT, BOX_WIDTH, draw

WORKFLOW = """
name: flow
stages:
  - {id: guard, type: policy}
  - {id: classify, type: llm, with: {system: "Classify."}}
  - {id: context, type: retrieve, needs: [guard], with: {index: handbook}}
  - {id: answer, type: llm, needs: [classify, context], stream: true, fallback: spare, with: {system: "Answer."}}
  - {id: spare, type: llm, with: {model: big, system: "Answer."}}
  - {id: log, type: audit, always: true}
"""


def test_steps_that_may_run_together_share_a_layer_and_every_need_is_an_arrow(registry, catalog):
    drawing = draw(load_pipeline_text(WORKFLOW, "flow.yaml", registry, catalog))
    boxes = {box.id: box for box in drawing.boxes}
    assert [box.id for box in drawing.boxes] == ["guard", "classify", "context", "answer", "spare", "log"]
    assert {step: box.layer for step, box in boxes.items()} == {
        "guard": 0, "classify": 1, "context": 1, "answer": 2, "spare": 2, "log": 3}
    assert boxes["classify"].y == boxes["context"].y and boxes["classify"].x < boxes["context"].x
    assert boxes["spare"].x == boxes["answer"].x + BOX_WIDTH + 28  # the fallback right beside its primary
    # The audit step waits for every step before it; it is drawn from the last of them only.
    assert {(a.source, a.target, a.kind) for a in drawing.arrows} == {
        ("guard", "classify", "needs"), ("guard", "context", "needs"), ("classify", "answer", "needs"),
        ("context", "answer", "needs"), ("answer", "log", "needs"), ("answer", "spare", "fallback")}
    assert set(boxes["answer"].kinds) == {"stream"} and boxes["spare"].kinds == ("fallback",)
    assert boxes["spare"].title == "spare (llm): runs in the place of answer"
    assert boxes["answer"].title == "answer (llm): needs classify, context"
    lowest = max(box.y for box in drawing.boxes)
    assert drawing.height >= lowest + BOX_HEIGHT and drawing.width >= boxes["spare"].x + BOX_WIDTH
    assert "4 layers" in drawing.summary


def test_a_chain_is_one_column_and_a_loop_has_an_arrow_back(registry, catalog):
    text = """
name: loop
stages:
  - {id: draft, type: llm, with: {system: "Draft."}}
  - id: check
    type: llm
    repeat: {from: draft, until: "steps.check.output.passed", max: 3}
    with:
      system: "Judge."
      output: {json_schema: {type: object, properties: {passed: {type: boolean}}, required: [passed]}}
  - {id: a_step_with_a_rather_long_identifier, type: audit, always: true}
"""
    drawing = draw(load_pipeline_text(text, "loop.yaml", registry, catalog))
    assert len({box.x for box in drawing.boxes}) == 1 and [box.layer for box in drawing.boxes] == [0, 1, 2]
    kinds = {(a.source, a.target, a.kind) for a in drawing.arrows}
    assert ("check", "draft", "repeat") in kinds and ("draft", "check", "needs") in kinds
    assert drawing.boxes[2].label == "a_step_with_a_rat…"
