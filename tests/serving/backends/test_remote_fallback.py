"""A pipeline whose remote backend answers 429, 500 or nothing falls back to a local model (mock transport)."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import httpx
import pytest

from pipeline.context import RequestContext
from pipeline.events import Done, TextDelta
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from serving.backends.remote import open_remote
from serving.config.models import ModelSpec
from tests.fakes import FakeEngine, FakeEngines

CATALOG = Catalog(models={"remote": ModelInfo("remote"), "smol": ModelInfo("smol")})
PIPELINE = """
name: p
stages:
  - {id: prompt, type: prompt}
  - {id: pick, type: route, with: {default: remote, fallback: [smol], first_token_timeout_s: 0.5}}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 16, temperature: 0}}
  - {id: out, type: stream}
"""


async def hang(request: httpx.Request) -> httpx.Response:
    await asyncio.sleep(30)
    return httpx.Response(200)


@pytest.mark.parametrize(("handler", "error"), [
    (lambda request: httpx.Response(429, headers={"Retry-After": "3"}, json={"error": {"message": "busy"}}),
     "overloaded"),
    (lambda request: httpx.Response(503, json={"error": {"message": "down"}}), "backend_error"),
    (hang, "backend_error"),
])
async def test_a_failing_remote_falls_back_to_the_local_model(registry, handler, error):
    spec = ModelSpec(backend="openai", base_url="http://remote.invalid/v1", timeout_s=0.3)
    remote = open_remote("remote", spec, Path("."), transport=httpx.MockTransport(handler))
    engines = FakeEngines(smol=FakeEngine("Local answer."))
    engines.engines["remote"] = remote
    loaded = load_pipeline_text(textwrap.dedent(PIPELINE), "p.yaml", registry, CATALOG)
    pipeline = Pipeline(loaded, Resources(CATALOG, engines=engines))
    ctx = RequestContext.from_text("p", "Hello")
    try:
        events = [event async for event in Runner().stream(pipeline, ctx)]
    finally:
        await remote.aclose()
    assert isinstance(events[-1], Done)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Local answer."
    assert ctx.model == "smol" and ctx.facts["route"]["fallbacks_tried"][0] == {
        "model": "remote", "attempt": 1, "error": error}
