"""The audit stage writes one record per request: served, failed, denied or disconnected."""

from __future__ import annotations

import hashlib
import json
import textwrap
from datetime import UTC, datetime

import pytest

from pipeline.context import ChatMessage, Principal, RequestContext
from pipeline.digest import digest
from pipeline.events import TextDelta
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from store.audit import normalize
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


GUARDED = """
name: chat
stages:
  - {id: guard, type: policy, with: {pii: redact}}
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 64, temperature: 0, seed: 5}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true, with: {content: CONTENT, subject: tags.user}}
"""


@pytest.mark.parametrize(("mode", "expected"), [
    ("full", {"tier": "gold", "user": "alice@example.com"}),
    ("redacted", {"tier": "gold", "user": "<EMAIL_1>"}),
    ("hash", {"tier": hashlib.sha256(b"gold").hexdigest(), "user": hashlib.sha256(b"alice@example.com").hexdigest()}),
    ("encrypted", {"tier": "gold", "user": "alice@example.com"}),  # in clear to the sink, which encrypts them
])
async def test_the_tags_are_kept_as_the_content_is_and_the_user_only_among_them(registry, mode, expected):
    sink = ListSink()
    loaded = load_pipeline_text(GUARDED.replace("CONTENT", mode), "p.yaml", registry, CATALOG)
    pipeline = Pipeline(loaded, Resources(CATALOG, engines=FakeEngines(smol=FakeEngine("Paris.")), audit=sink))
    ctx = RequestContext.from_text("chat", "Capital?", tags={"user": "alice@example.com", "tier": "gold"})
    await Runner().run(pipeline, ctx)
    (record,) = sink.records
    assert record["content_mode"] == mode
    assert json.loads(record["tags"]) == expected
    assert "user" not in record["params"] and "alice" not in json.dumps(record["params"])
    assert record.get("content_subject") == ("tags.user:alice@example.com" if mode == "encrypted" else None)


async def test_a_request_without_tags_keeps_none(registry):
    sink = ListSink()
    await Runner().run(build(registry, sink, "full"), RequestContext.from_text("chat", "Capital?"))
    assert sink.records[0]["tags"] is None


@pytest.mark.parametrize("mode", ["full", "redacted", "hash"])
async def test_a_chat_of_several_turns_is_kept_whole_as_the_content_is(registry, mode):
    # Replay sends a chat again only if the record keeps its earlier turns, not only its last message.
    sink = ListSink()
    loaded = load_pipeline_text(GUARDED.replace("CONTENT", mode), "p.yaml", registry, CATALOG)
    pipeline = Pipeline(loaded, Resources(CATALOG, engines=FakeEngines(smol=FakeEngine("Paris.")), audit=sink))
    turns = [ChatMessage("user", "I am bob@example.com"), ChatMessage("assistant", "Hello."),
             ChatMessage("user", "Capital?")]
    await Runner().run(pipeline, RequestContext("chat", turns))
    (record,) = sink.records
    sent = [{"role": m.role, "content": m.content} for m in turns]
    assert record["params"]["turns"] == 3
    if mode == "full":  # as the client sent it, before the policy's redaction
        assert json.loads(record["input_content"]) == sent
    elif mode == "redacted":
        assert json.loads(record["input_content"])[0] == {"role": "user", "content": "I am <EMAIL_1>"}
    else:
        assert record["input_content"] == hashlib.sha256(json.dumps(sent, ensure_ascii=False).encode()).hexdigest()


FLOW = """
name: flow
stages:
  - {id: guard, type: policy, with: {pii: redact}}
  - {id: answer, type: llm, stream: true, with: {system: "Answer.", temperature: 0}}
  - {id: refund, type: llm, when: "steps.answer.output == 'refund'", with: {system: "Refunds."}}
  - {id: log, type: audit, always: true, with: {content: CONTENT}}
"""


@pytest.mark.parametrize("mode", ["full", "redacted", "hash", "encrypted"])
async def test_each_step_is_kept_with_its_values_only_with_full_content(registry, mode):
    # Only full keeps the values of what each step read and gave (hash keeps their SHA-256, redacted and
    # encrypted neither): they hold the content (here the address before the policy redacted it), which would
    # sit outside its redaction or encryption.
    sink = ListSink()
    loaded = load_pipeline_text(FLOW.replace("CONTENT", mode), "p.yaml", registry, CATALOG)
    pipeline = Pipeline(loaded, Resources(CATALOG, engines=FakeEngines(smol=FakeEngine("Paris.")), audit=sink))
    await Runner().run(pipeline, RequestContext.from_text("flow", "I am alice@example.com. Capital?"))
    (record,) = sink.records
    assert record["content_mode"] == mode
    steps = {s["stage_id"]: s["step"] for s in record["stages"]}
    assert list(steps) == ["guard", "answer", "refund"]
    assert steps["refund"] == {"attempt": 1, "started_ms": steps["refund"]["started_ms"], "skip_reason": "when"}
    answer = steps["answer"]
    assert answer["attempt"] == 1 and answer["input_tokens"] > 0 and answer["output_tokens"] == len("Paris.")
    hashed = ("inputs_sha256", "output_sha256")
    assert len(answer["definition_sha256"]) == 64
    if mode in ("full", "hash"):
        assert all(len(answer[name]) == 64 for name in hashed)
    else:  # hashes of a redacted or encrypted record's content could be checked against guesses, even after erasure
        assert not any(name in answer for name in hashed)
    if mode == "full":
        assert answer["output"]["text"] == "Paris." and digest(answer["output"]) == answer["output_sha256"]
        assert steps["guard"]["inputs"]["input_messages"][0]["content"] == "I am alice@example.com. Capital?"
        assert answer["inputs"]["input"] == "I am <EMAIL_1>. Capital?"  # as the policy redacted it
    else:
        assert all({"inputs", "output"}.isdisjoint(step) for step in steps.values())
        assert "alice" not in json.dumps(record["stages"]) and "Paris" not in json.dumps(record["stages"])
    # What the audit store keeps of each stage row (the sink takes the subject out first): the step as built.
    _, rows = normalize({k: v for k, v in record.items() if k != "content_subject"}, datetime.now(UTC))
    assert [row["step"] for row in rows] == list(steps.values())
