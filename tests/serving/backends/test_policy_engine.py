"""Output rails on the real engine: a block stops generation in the engine, not only on the wire."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from pipeline.context import RequestContext
from pipeline.events import Done, TextDelta
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Resources
from pipeline.runner import Pipeline, Runner
from serving.config.loader import catalog_of
from serving.runtime.workspace import open_workspace

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[3]

GUARDED = """
name: guarded
stages:
  - id: guard
    type: policy
    with:
      deny: [{id: city, category: geography, keywords: [paris]}]
      output: {deny: true, hold_back_chars: 8}
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 64, temperature: 0, ignore_eos: true}}
  - {id: out, type: stream}
"""


async def test_a_blocked_answer_stops_in_the_engine(monkeypatch):
    from serving.backends.model_pool import ModelPool

    monkeypatch.chdir(ROOT)
    workspace = open_workspace(str(ROOT / "inferline.yaml"))
    pool = ModelPool(workspace.server, workspace.root)
    catalog = catalog_of(workspace.server)
    loaded = load_pipeline_text(textwrap.dedent(GUARDED), "guarded.yaml", workspace.registry, catalog)
    pipeline = Pipeline(loaded, Resources(catalog, engines=pool))
    try:
        ctx = RequestContext.from_text("guarded", "What is the capital of France?")
        events = [event async for event in Runner().stream(pipeline, ctx)]
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        assert isinstance(events[-1], Done)
        assert ctx.finish_reason == "content_filter"
        assert "Paris" not in text and text.startswith("The capital of France")
        # Aborted: far fewer than the 64 tokens ignore_eos would have made, and nothing left running.
        assert ctx.usage.output_tokens < 20
        engine = (await pool.get("smol")).engine
        for _ in range(100):
            stats = engine.stats()
            if stats["running"] == 0 and stats["waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        assert (stats["running"], stats["waiting"]) == (0, 0)
    finally:
        await pool.close()


async def test_the_guard_classifier_runs_on_the_real_model(monkeypatch):
    from serving.backends.model_pool import ModelPool

    monkeypatch.chdir(ROOT)
    workspace = open_workspace(str(ROOT / "inferline.yaml"))
    pool = ModelPool(workspace.server, workspace.root)
    catalog = catalog_of(workspace.server)
    yaml_text = GUARDED.replace("deny: [{id: city, category: geography, keywords: [paris]}]",
                                "classifier: {model: smol, action: flag, threshold: 0.5}")
    loaded = load_pipeline_text(textwrap.dedent(yaml_text), "guarded.yaml", workspace.registry, catalog)
    pipeline = Pipeline(loaded, Resources(catalog, engines=pool))
    try:
        ctx = RequestContext.from_text("guarded", "What is the capital of France?")
        final = await Runner().run(pipeline, ctx)
        assert isinstance(final, Done)
        verdict = ctx.facts["decisions"]["guard"]["classifier"]
        # SmolLM2-135M is too small to be a good guard; what is checked is the plumbing: a probability
        # from the first token's logprobs and a verdict that agrees with it.
        assert 0.0 <= verdict["score"] <= 1.0
        assert verdict["verdict"] == ("unsafe" if verdict["score"] >= 0.5 else "safe")
    finally:
        await pool.close()
