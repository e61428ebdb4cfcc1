"""The audit stage writes one record per request: served, failed, denied or disconnected."""

from __future__ import annotations

import hashlib
import textwrap

import pytest

from pipeline.context import Principal, RequestContext
from pipeline.events import TextDelta
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from tests.fakes import FakeEngine, FakeEngines


class ListSink:
    def __init__(self):
        self.records = []

    async def write(self, record):
        self.records.append(record)


CATALOG = Catalog(models={"smol": ModelInfo("smol")})
BASE = """
name: chat
version: "3"
stages:
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 64, temperature: 0, seed: 5}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true, with: {content: CONTENT}}
"""


def build(registry, sink, content="hash", extra="", engine=None):
    text = textwrap.dedent(BASE.replace("CONTENT", content)) + textwrap.dedent(extra)
    loaded = load_pipeline_text(text, "p.yaml", registry, CATALOG)
    engines = FakeEngines(smol=engine or FakeEngine("Paris."))
    return Pipeline(loaded, Resources(CATALOG, engines=engines, audit=sink))


async def test_served_request_record(registry):
    sink = ListSink()
    ctx = RequestContext.from_text("chat", "Capital?", principal=Principal("key1", "caller", "acme"))
    await Runner().run(build(registry, sink), ctx)
    (record,) = sink.records
    assert record["status"] == "ok" and record["finish_reason"] == "stop"
    assert (record["key_id"], record["role"], record["pipeline"], record["pipeline_version"]) == \
        ("key1", "caller", "chat", "3")
    assert record["spec_sha256"] == ctx.spec_sha256 and len(record["spec_sha256"]) == 64
    assert record["params"] == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 64, "seed": 5}
    assert record["weights_hash"] == "f" * 64 and record["model"] == "smol"
    assert record["content_mode"] == "hash"
    assert record["input_content"] == hashlib.sha256(b"Capital?").hexdigest()
    assert record["output_tokens"] == len("Paris.") and record["ttft_ms"] is not None
    assert [s["stage_id"] for s in record["stages"]] == ["prompt", "tok", "gen", "out"]


async def test_full_content(registry):
    sink = ListSink()
    await Runner().run(build(registry, sink, "full"), RequestContext.from_text("chat", "Capital?"))
    assert (sink.records[0]["input_content"], sink.records[0]["output_content"]) == ("Capital?", "Paris.")


async def test_failed_request_is_recorded(registry):
    sink = ListSink()
    pipeline = build(registry, sink)
    final = await Runner().run(pipeline, RequestContext.from_text("chat", "x", params={"max_tokens": 999}))
    assert final.status == "failed"
    (record,) = sink.records
    assert (record["status"], record["error_type"]) == ("failed", "invalid_input")


async def test_denied_request_is_recorded(registry):
    sink = ListSink()
    text = textwrap.dedent("""
        name: chat
        stages:
          - {id: guard, type: deny}
          - {id: log, type: audit, always: true}
    """)
    pipeline = Pipeline(load_pipeline_text(text, "p.yaml", registry, CATALOG), Resources(CATALOG, audit=sink))
    await Runner().run(pipeline, RequestContext.from_text("chat", "x"))
    assert (sink.records[0]["status"], sink.records[0]["error_type"]) == ("denied", "policy_denied")


async def test_disconnected_request_is_recorded(registry):
    sink = ListSink()
    pipeline = build(registry, sink, engine=FakeEngine("a long answer " * 30))
    stream = Runner().stream(pipeline, RequestContext.from_text("chat", "x"))
    async for event in stream:
        if isinstance(event, TextDelta):
            break
    await stream.aclose()
    (record,) = sink.records
    assert record["status"] == "disconnected"
    assert record["stages"][-1]["status"] == "cancelled"


async def test_missing_sink_fails_loudly(registry):
    loaded = load_pipeline_text("name: x\nstages: [{id: log, type: audit}]\n", "p.yaml", registry, CATALOG)
    final = await Runner().run(Pipeline(loaded, Resources(CATALOG)), RequestContext.from_text("x", "y"))
    assert final.kind == "backend_error"


@pytest.mark.parametrize("mode", ["full", "redacted", "hash"])
async def test_redacted_uses_policy_text_or_falls_back_to_hash(registry, mode):
    sink = ListSink()
    await Runner().run(build(registry, sink, mode), RequestContext.from_text("chat", "secret"))
    expected = {"full": "full", "redacted": "hash", "hash": "hash"}[mode]
    assert sink.records[0]["content_mode"] == expected
