"""bench/workflow.py measures what it says: its graphs have the shapes it names, its pair of model steps overlaps
only when not chained, every answer is the length it asks for, and a short run gives every figure. Over fake
engines: the figures themselves come from running the bench on the real model."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from bench import workflow
from pipeline.context import RequestContext
from pipeline.events import Done
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from serving.runtime.resources import RuntimeOptions
from serving.runtime.workspace import open_workspace
from tests.fakes import FakeEngine, FakeEngines

CATALOG = Catalog(models={"smol": ModelInfo("smol")})
SERVER = """
models:
  smol: {{source: models/smollm2-135m-instruct}}
database: sqlite:///{db}
pipelines: pipelines/
"""


class TriageEngine(FakeEngine):
    """Classifies every request as *intent* (the classifier's prompt asks for JSON) and answers every other prompt
    with more text than any step asks for, so that each gives exactly its max_tokens."""

    def __init__(self, intent: str):
        super().__init__("word " * 40)
        self.classification = json.dumps({"intent": intent, "urgency": 2}, separators=(",", ":")).encode()

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        stream = await super().submit(prompt_ids, sampling, cache_salt, hints=hints)
        if b"JSON object" in bytes(prompt_ids):
            stream.reply = self.classification
        return stream


def test_noop_graph_is_layers_of_two_each_joining_the_layer_before():
    graph = workflow.noop_pipeline(workflow.noop_graph_yaml()).graph
    assert len(graph.ids) == 2 * workflow.NUM_LAYERS
    assert graph.deps["s0a"] == graph.deps["s0b"] == ()
    for layer in range(1, workflow.NUM_LAYERS):
        for side in "ab":
            assert set(graph.deps[f"s{layer}{side}"]) == {f"s{layer - 1}a", f"s{layer - 1}b"}
    assert not graph.is_chain


def test_noop_chain_is_a_chain_of_as_many_steps():
    graph = workflow.noop_pipeline(workflow.noop_chain_yaml()).graph
    assert len(graph.ids) == 2 * workflow.NUM_LAYERS
    assert graph.is_chain


async def test_step_overhead_reports_both_shapes_per_step():
    figures = await workflow.step_overhead(num_requests=3, num_repeats=2)
    assert len(figures["step_overhead_graph_us_repeats"]) == len(figures["step_overhead_chain_us_repeats"]) == 2
    assert figures["step_overhead_us"] == min(figures["step_overhead_graph_us_repeats"])
    assert figures["step_overhead_chain_us"] == min(figures["step_overhead_chain_us_repeats"])
    assert figures["step_overhead_ratio"] == pytest.approx(
        figures["step_overhead_us"] / figures["step_overhead_chain_us"], rel=0.01)


@pytest.mark.parametrize("chained", [False, True])
async def test_pair_overlaps_only_when_not_chained(registry, chained):
    loaded = load_pipeline_text(workflow.pair_yaml("pair", chained), "pair.yaml", registry, CATALOG)
    pipeline = Pipeline(loaded, Resources(CATALOG, engines=FakeEngines(smol=TriageEngine("tech"))))
    final = await Runner().run(pipeline, RequestContext.from_text("pair", workflow.INPUT))
    assert isinstance(final, Done)
    summary, reply = final.summary.stages
    assert (summary.id, reply.id) == ("summary", "reply")
    assert summary.output_tokens == reply.output_tokens == workflow.PAIR_TOKENS
    overlapped = reply.started_s < summary.started_s + summary.duration_s
    assert overlapped is not chained


@pytest.mark.parametrize("intent", ["refund", "other"])
def test_model_figures_has_every_figure_and_triage_takes_the_classified_branch(tmp_path, monkeypatch, intent):
    monkeypatch.delenv("INFERLINE_DATABASE", raising=False)
    config = tmp_path / "inferline.yaml"
    config.write_text(SERVER.format(db=tmp_path / "bench.db"))
    (tmp_path / "pipelines").mkdir()
    workspace = open_workspace(str(config))
    sizes = replace(workflow.QUICK, num_runs=2, num_rounds=1)
    options = RuntimeOptions(engines=FakeEngines(smol=TriageEngine(intent)))
    figures = asyncio.run(workflow.model_figures(workspace, sizes, options))
    assert figures["triage_intents"] == {intent: workflow.NUM_CLIENTS}
    for suffix in ("", "_no_spec"):
        assert len(figures[f"parallel_ms{suffix}"]) == len(figures[f"chained_ms{suffix}"]) == 2
    assert len(figures["triage_ms"]) == len(figures["chain_ms"]) == workflow.NUM_CLIENTS
    expected = {"parallel_speedup", "parallel_speedup_no_spec", "engine_pair_speedup", "engine_pair_speedup_no_spec",
                "engine_decode_step_ms_batch1", "engine_decode_step_ms_batch2", "triage_vs_chain_ms_p50",
                "triage_classify_ms_p50", "triage_answer_ms_p50", "chain_answer_ms_p50"}
    assert expected <= figures.keys()
    assert all(isinstance(figures[key], float) for key in expected)


class DraftCheckEngine(FakeEngine):
    """Drafts a fixed answer and judges every draft good (the judge's prompt asks for JSON)."""

    def __init__(self):
        super().__init__("Thanks for writing: we will look into your order.")

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        stream = await super().submit(prompt_ids, sampling, cache_salt, hints=hints)
        if b"You review" in bytes(prompt_ids):
            stream.reply = b'{"passed": true, "reasons": "fine"}'
        return stream


def test_replay_reuse_replays_the_recorded_drafts_by_step_and_in_full(tmp_path, monkeypatch):
    monkeypatch.delenv("INFERLINE_DATABASE", raising=False)
    config = tmp_path / "inferline.yaml"
    config.write_text(SERVER.format(db=tmp_path / "bench.db"))
    (tmp_path / "pipelines").mkdir()
    workspace = open_workspace(str(config))
    engine = DraftCheckEngine()
    figures = asyncio.run(workflow.replay_reuse(workspace, 3, RuntimeOptions(engines=FakeEngines(smol=engine))))
    drafts = [prompt for prompt, _, _ in engine.submitted if b"You review" not in bytes(prompt)]
    assert len(drafts) == 3 + 3  # recorded, then written again by --full only
    assert figures["replay_requests"] == figures["replay_drafts_reused"] == figures["replay_answers_identical"] == 3
    assert figures["replay_reused_identical"] is True
    assert figures["replay_output_tokens"]["step"] < figures["replay_output_tokens"]["full"]
    # By step, the judge and the audit step (the reply reads what it read before); in full, the draft and reply too.
    assert figures["replay_steps_rerun"] == {"step": 3 * 2, "full": 3 * 4}
    assert isinstance(figures["replay_reuse_speedup"], float)


def test_map_input_splits_in_one_chunk_per_part():
    from stages.split import split_text

    text = workflow.map_input()
    chunks = split_text(text, 1500)  # summarize_long's chunk_chars
    assert chunks == text.split("\n\n") and len(chunks) == workflow.MAP_CHUNKS
    assert "concurrency: 1\n" in workflow.map_yaml(1) and "concurrency: 8" not in workflow.map_yaml(1)


def test_map_figures_runs_the_chunks_eight_at_a_time_against_one_at_a_time(tmp_path, monkeypatch):
    monkeypatch.delenv("INFERLINE_DATABASE", raising=False)
    config = tmp_path / "inferline.yaml"
    config.write_text(SERVER.format(db=tmp_path / "bench.db"))
    (tmp_path / "pipelines").mkdir()
    workspace = open_workspace(str(config))
    engine = FakeEngine("A short summary of this part. " * 4)
    figures = asyncio.run(workflow.map_figures(workspace, 2, RuntimeOptions(engines=FakeEngines(smol=engine))))
    assert figures["map_items_in_flight"] == {"concurrency_8": 8, "concurrency_1": 1}
    assert figures["map_chunks"] == 8 and figures["map_outputs_identical"] is True
    assert len(figures["map_ms"]) == len(figures["map_serial_ms"]) == 2
    # Per concurrency: a warm-up and 2 requests of 8 chunks and a combining call; then the engine's 8, one after
    # the other and at once, 2 times, with speculation and without.
    assert len(engine.submitted) == 2 * 3 * (8 + 1) + 2 * 2 * 2 * 8
    assert all(isinstance(figures[key], float) for key in ("map_speedup", "map_step_speedup", "map_engine_speedup",
                                                           "map_engine_speedup_no_spec"))
