"""Workflows: steps with named outputs, side by side, branches, retries and fallbacks, over fake engines."""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

from pipeline.context import RequestContext
from pipeline.errors import SpecError
from pipeline.events import Done, Error, StageFinished, StageStarted, TextDelta
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from tests.fakes import FakeEngine, FakeEngines, FakeStream

CATALOG = Catalog(models={"smol": ModelInfo("smol"), "big": ModelInfo("big")})
INTENT = {"type": "object", "properties": {"intent": {"enum": ["refund", "tech", "other"]},
                                           "amount": {"type": "number"}}, "required": ["intent", "amount"]}


class ScriptedEngine(FakeEngine):
    """Answers by the system message's first word (``Classify`` gets JSON); each answer streams one byte every
    *delay_s*; the replies listed in *fail_first* fail their first submission, once."""

    def __init__(self, replies: dict[str, str], delay_s: float = 0.0, fail_first: tuple[str, ...] = ()):
        super().__init__()
        self.replies, self.delay_s, self.failing = replies, delay_s, set(fail_first)
        self.prompts: list[str] = []

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        prompt = bytes(prompt_ids).decode(errors="replace")
        self.prompts.append(prompt)
        key = next((k for k in self.replies if k in prompt), "")
        reply = self.replies.get(key, "ok")
        if key in self.failing:
            self.failing.discard(key)
            reply = self.replies.get(f"{key}!", reply)
        stream = SlowStream(reply.encode(), len(prompt_ids), sampling.max_tokens, self.delay_s)
        self.streams.append(stream)
        return stream


class SlowStream(FakeStream):
    def __init__(self, reply: bytes, prompt_len: int, max_tokens: int, delay_s: float):
        super().__init__(reply, prompt_len, max_tokens)
        self.delay_s = delay_s

    async def __anext__(self):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return await super().__anext__()


def pipeline(registry, text: str, engine: FakeEngine) -> Pipeline:
    loaded = load_pipeline_text(textwrap.dedent(text), "wf.yaml", registry, CATALOG)
    return Pipeline(loaded, Resources(CATALOG, engines=FakeEngines(smol=engine, big=engine)))


async def run(p: Pipeline, text: str = "my order never came"):
    ctx = RequestContext.from_text(p.name, text)
    events = [event async for event in Runner().stream(p, ctx)]
    return ctx, events


TRIAGE = f"""
name: triage
stages:
  - id: classify
    type: llm
    with:
      system: "Classify the request."
      temperature: 0
      output: {{json_schema: {json.dumps(INTENT)}}}
  - id: refund
    type: llm
    when: "steps.classify.output.intent == 'refund'"
    with: {{system: "Refunds: answer.", temperature: 0}}
  - id: tech
    type: llm
    needs: [classify]
    when: "steps.classify.output.intent == 'tech'"
    with: {{system: "Tech: answer.", temperature: 0}}
  - id: answer
    type: llm
    needs: [refund, tech]
    with: {{system: "Polish: {{{{ coalesce(steps.refund.output, steps.tech.output) }}}}", temperature: 0}}
  - id: big
    type: reply
    needs: [classify]
    when: "steps.classify.output.amount > 500"
    with: {{text: "A person will write to you."}}
"""


async def test_a_branch_runs_and_the_other_is_skipped_and_recorded(registry):
    engine = ScriptedEngine({"Classify": '{"intent": "refund", "amount": 20}', "Refunds": "Refund sent.",
                             "Polish": "Your refund is on its way."})
    ctx, events = await run(pipeline(registry, TRIAGE, engine))
    assert isinstance(events[-1], Done)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Your refund is on its way."
    assert {e.stage_id for e in events if isinstance(e, TextDelta)} == {"answer"}  # the last llm step answers
    skipped = {r.id: r.skip_reason for r in ctx.stages if r.status == "skipped"}
    assert skipped == {"tech": "when", "big": "when"}
    assert ctx.steps["classify"]["output"] == {"intent": "refund", "amount": 20}
    assert "Polish: Refund sent." in engine.prompts[-1]  # coalesce read the branch that ran
    assert ctx.usage.output_tokens == sum(r.output_tokens for r in ctx.stages) > len("Your refund is on its way.")


async def test_a_reply_ends_the_request_with_its_fixed_answer(registry):
    engine = ScriptedEngine({"Classify": '{"intent": "refund", "amount": 900}', "Refunds": "Refund sent.",
                             "Polish": "never"})
    ctx, events = await run(pipeline(registry, TRIAGE, engine))
    done = events[-1]
    assert isinstance(done, Done) and done.summary.output_text == "A person will write to you."
    assert {r.id: r.skip_reason for r in ctx.stages if r.status == "skipped"} == {"tech": "when", "answer": "ended"}


async def test_steps_that_do_not_need_each_other_run_at_the_same_time(registry):
    text = """
    name: both
    stages:
      - {id: one, type: llm, needs: [], with: {system: "First.", max_tokens: 8}}
      - {id: two, type: llm, needs: [], with: {system: "Second.", max_tokens: 8}}
      - {id: join, type: llm, needs: [one, two], with: {system: "Join {{ steps.one.output }} {{ steps.two.output }}"}}
    """
    engine = ScriptedEngine({"First": "aaaa", "Second": "bbbb", "Join": "done"}, delay_s=0.02)
    ctx, events = await run(pipeline(registry, text, engine))
    assert isinstance(events[-1], Done)
    one, two = (next(r for r in ctx.stages if r.id == step) for step in ("one", "two"))
    assert one.started_s < two.started_s + two.duration_s and two.started_s < one.started_s + one.duration_s
    starts = [e.stage_id for e in events if isinstance(e, StageStarted)]
    assert starts[:2] == ["one", "two"]  # both started before either finished
    assert "Join aaaa bbbb" in engine.prompts[-1]


async def test_a_retried_attempt_never_reaches_the_client(registry):
    text = f"""
    name: strict
    stages:
      - id: answer
        type: llm
        retry: {{attempts: 2, on: [invalid_output]}}
        with: {{system: "Classify.", output: {{json_schema: {json.dumps(INTENT)}}}}}
    """
    engine = ScriptedEngine({"Classify": '{"intent": "tech", "amount": 1}', "Classify!": "not json"},
                            fail_first=("Classify",))
    ctx, events = await run(pipeline(registry, text, engine))
    assert isinstance(events[-1], Done)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == '{"intent": "tech", "amount": 1}'
    attempts = [(r.attempt, r.status) for r in ctx.stages]
    assert attempts == [(1, "failed"), (2, "ok")]
    first = next(e for e in events if isinstance(e, StageFinished) and e.attempt == 1)
    assert first.retrying and "does not match its json_schema" in first.error


async def test_a_fallback_runs_in_the_place_of_a_failed_step(registry):
    text = f"""
    name: spare
    stages:
      - id: answer
        type: llm
        fallback: backup
        with: {{model: smol, system: "Classify.", output: {{json_schema: {json.dumps(INTENT)}}}}}
      - {{id: backup, type: llm, with: {{model: big, system: "Backup."}}}}
      - {{id: after, type: llm, with: {{system: "After {{{{ steps.answer.output }}}}"}}}}
    """
    engine = ScriptedEngine({"Classify": "not json", "Backup": "saved", "After": "fine"})
    ctx, events = await run(pipeline(registry, text, engine))
    assert isinstance(events[-1], Done), events[-1]
    assert [(r.id, r.status, r.fallback_for) for r in ctx.stages] == [
        ("answer", "failed", ""), ("backup", "ok", "answer"), ("after", "ok", "")]
    assert "After saved" in engine.prompts[-1] and events[-1].summary.output_text == "fine"


async def test_a_failed_step_fails_the_request_and_cancels_its_neighbours(registry):
    text = f"""
    name: broken
    stages:
      - {{id: slow, type: llm, needs: [], with: {{system: "Slow."}}}}
      - {{id: bad, type: llm, needs: [], with: {{system: "Classify.", output: {{json_schema: {json.dumps(INTENT)}}}}}}}
      - {{id: log, type: llm, always: true, needs: [slow, bad], with: {{system: "Always."}}}}
    """
    engine = ScriptedEngine({"Slow": "z" * 200, "Classify": "nope", "Always": "logged"}, delay_s=0.01)
    ctx, events = await run(pipeline(registry, text, engine))
    assert isinstance(events[-1], Error) and events[-1].kind == "invalid_output"
    assert {r.id: r.status for r in ctx.stages} == {"slow": "cancelled", "bad": "failed", "log": "ok"}


@pytest.mark.parametrize(("extra", "where", "message"), [
    ("      - {id: x, type: llm, needs: [y], with: {system: a}}\n      - {id: y, type: llm, needs: [x], with: {}}\n",
     ":8:", "these steps need each other in a circle: x -> y -> x"),
    ("      - {id: x, type: llm, needs: [clasify], with: {}}\n", ":8:", "no step 'clasify'; did you mean 'classify'?"),
    ("      - {id: x, type: llm, needs: [classify], with: {system: '{{ steps.classify.outptu }}'}}\n", ":8:",
     "step 'classify' (llm) gives no 'outptu'; did you mean 'output'?"),
    ("      - {id: x, type: llm, needs: [classify], when: \"steps.classify.output.intent == 'refnd'\"}\n", ":8:",
     "is one of 'refund', 'tech', 'other': == 'refnd' is never true; did you mean 'refund'?"),
    ("      - {id: x, type: llm, needs: [classify], when: \"steps.classify.output.amount > 'lots'\"}\n", ":8:",
     "steps.classify.output.amount is a number and 'lots' is a string"),
    ("      - {id: x, type: llm, needs: [refund], with: {system: '{{ steps.refund.output }}'}}\n", ":8:",
     "step 'refund' runs only when its when: holds, so it may give nothing: read it as "
     "coalesce(steps.refund.output, ...)"),
    ("      - {id: x, type: llm, needs: [], with: {system: '{{ steps.classify.output }}'}}\n", ":8:",
     "step 'classify' runs beside it, not before: add 'classify' to the needs of 'x'"),
])
def test_graph_errors_name_file_line_and_the_fix(registry, extra, where, message):
    text = textwrap.dedent(f"""
    name: wf
    stages:
      - id: classify
        type: llm
        with: {{output: {{json_schema: {json.dumps(INTENT)}}}}}
      - {{id: refund, type: llm, when: "steps.classify.output.intent == 'refund'", with: {{}}}}
    """) + textwrap.indent(textwrap.dedent(extra), "  ")
    with pytest.raises(SpecError) as info:
        load_pipeline_text(text, "wf.yaml", registry, CATALOG)
    assert any(message in str(issue) and f"wf.yaml{where}" in str(issue) for issue in info.value.issues), \
        str(info.value)


def test_every_chain_keeps_its_shape(registry):
    loaded = load_pipeline_text(textwrap.dedent("""
    name: chat
    stages:
      - {id: prompt, type: prompt}
      - {id: tok, type: tokenize}
      - {id: gen, type: generate}
      - {id: out, type: stream}
      - {id: log, type: audit, always: true}
    """), "chat.yaml", registry, CATALOG)
    graph = loaded.graph
    assert graph is not None and graph.deps["gen"] == ("tok",) and graph.deps["log"] == ("prompt", "tok", "gen",
                                                                                         "out")
    assert loaded.plan("gen").outputs["token_stream"].name == "AsyncIterator[int] | None"


def test_retries_live_in_one_layer(registry):
    text = textwrap.dedent("""
    name: twice
    stages:
      - {id: pick, type: route, with: {default: smol, fallback: [big], retries: 2}}
      - {id: answer, type: llm, retry: {attempts: 3}, with: {}}
    """)
    with pytest.raises(SpecError, match="already retries each model 2 time\\(s\\): retries in both would multiply"):
        load_pipeline_text(text, "twice.yaml", registry, CATALOG)


async def test_the_branch_that_runs_answers_when_no_step_reads_the_branches(registry):
    text = f"""
    name: branches
    stages:
      - {{id: classify, type: llm, with: {{system: "Classify.", output: {{json_schema: {json.dumps(INTENT)}}}}}}}
      - {{id: refund, type: llm, needs: [classify], when: "steps.classify.output.intent == 'refund'",
          with: {{system: "Refunds."}}}}
      - {{id: tech, type: llm, needs: [classify], when: "steps.classify.output.intent == 'tech'",
          with: {{system: "Tech."}}}}
    """
    engine = ScriptedEngine({"Classify": '{"intent": "tech", "amount": 0}', "Tech": "Reboot.", "Refunds": "no"},
                            delay_s=0.001)
    p = pipeline(registry, text, engine)
    assert p.answers and {b.plan.spec.id for b in p.stages if b.streams} == {"refund", "tech"}
    _, events = await run(p)
    assert next((e.stage_id, e.text) for e in events if isinstance(e, TextDelta)) == ("tech", "R")
    assert events[-1].summary.output_text == "Reboot."


MAP = """
name: mapped
stages:
  - {id: split, type: split, with: {chunk_chars: 50}}
  - id: each
    type: llm
    for_each: steps.split.chunks
    concurrency: CONCURRENCY
    on_error: ON_ERROR
    with: {system: "Echo.", user: "{{ item_index }}:{{ item }}", max_tokens: 200}
  - {id: join, type: reply, with: {text: "{{ steps.each.output | join('|') }}"}}
"""


class EchoEngine(FakeEngine):
    """Answers each prompt's last line (the item) slowly, counting how many answers run at once; fails the items
    whose text says FAIL."""

    def __init__(self):
        super().__init__()
        self.now = self.most = 0

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        item = bytes(prompt_ids).decode(errors="replace").rsplit("<user>", 1)[-1]
        if "FAIL" in item:
            from pipeline.errors import BackendError
            raise BackendError("this item fails")
        self.now += 1
        self.most = max(self.most, self.now)
        stream = SlowStream(item.encode(), len(prompt_ids), sampling.max_tokens, 0.002)
        close = stream.aclose

        async def aclose():
            self.now -= 1
            await close()

        stream.aclose = aclose
        return stream


def text_of(n: int, fail: int = -1) -> str:
    return "\n\n".join(("FAIL this part of the text, whole" if i == fail else f"part number {i} of the longer text")
                       for i in range(n))


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_for_each_keeps_the_order_and_never_runs_more_than_its_concurrency(registry, concurrency):
    engine = EchoEngine()
    p = pipeline(registry, MAP.replace("CONCURRENCY", str(concurrency)).replace("ON_ERROR", "fail"), engine)
    ctx, events = await run(p, text_of(7))
    assert isinstance(events[-1], Done), events[-1]
    outputs = ctx.steps["each"]["output"]
    assert [o.split(":")[0] for o in outputs] == [str(i) for i in range(7)]  # in the items' order
    assert engine.most == concurrency
    assert sorted(r.item for r in ctx.stages if r.id == "each") == list(range(7))


async def test_a_failed_item_is_skipped_and_recorded_or_fails_the_request(registry):
    engine = EchoEngine()
    p = pipeline(registry, MAP.replace("CONCURRENCY", "2").replace("ON_ERROR", "skip"), engine)
    ctx, events = await run(p, text_of(4, fail=2))
    assert isinstance(events[-1], Done)
    assert ctx.steps["each"]["output"][2] is None and ctx.steps["each"]["output"][3].startswith("3:")
    assert [(r.item, r.status) for r in ctx.stages if r.id == "each" and r.status != "ok"] == [(2, "failed")]
    failing = pipeline(registry, MAP.replace("CONCURRENCY", "2").replace("ON_ERROR", "fail"), EchoEngine())
    ctx, events = await run(failing, text_of(4, fail=2))
    assert isinstance(events[-1], Error) and "this item fails" in events[-1].message


LOOP = """
name: looped
stages:
  - {id: draft, type: llm, with: {system: "Draft. {{ coalesce(steps.judge.output.reasons, 'first') }}"}}
  - id: judge
    type: llm
    repeat: {from: draft, until: "steps.judge.output.passed", max: MAX}
    with:
      system: "Judge."
      output: {json_schema: {type: object, properties: {passed: {type: boolean}, reasons: {type: string}},
                required: [passed, reasons]}}
  - {id: answer, type: reply, with: {text: "{{ steps.draft.output }} after {{ steps.draft.rounds | length }}"}}
"""


class JudgeEngine(ScriptedEngine):
    """The judge passes the *passes_at*-th draft."""

    def __init__(self, passes_at: int):
        super().__init__({})
        self.passes_at, self.drafts = passes_at, 0

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        prompt = bytes(prompt_ids).decode(errors="replace")
        if "Judge." in prompt:
            reply = json.dumps({"passed": self.drafts >= self.passes_at, "reasons": f"fix {self.drafts}"})
        else:
            self.drafts += 1
            reply = f"draft {self.drafts} ({prompt.split('Draft. ', 1)[1].split('<user>')[0]})"
        self.prompts.append(prompt)
        return SlowStream(reply.encode(), len(prompt_ids), sampling.max_tokens, 0)


async def test_a_loop_ends_when_its_until_holds(registry):
    ctx, events = await run(pipeline(registry, LOOP.replace("MAX", "5"), JudgeEngine(passes_at=2)))
    assert events[-1].summary.output_text == "draft 2 (fix 1) after 2"  # round 2 read round 1's judge
    assert [(r.id, r.round) for r in ctx.stages if r.id in ("draft", "judge")] == [
        ("draft", 1), ("judge", 1), ("draft", 2), ("judge", 2)]
    assert [r["output"] for r in ctx.steps["draft"]["rounds"]] == ["draft 1 (first)", "draft 2 (fix 1)"]


async def test_a_loop_ends_at_its_max(registry):
    _, events = await run(pipeline(registry, LOOP.replace("MAX", "3"), JudgeEngine(passes_at=99)))
    assert isinstance(events[-1], Done) and events[-1].summary.output_text == "draft 3 (fix 2) after 3"


@pytest.mark.parametrize(("change", "message"), [
    (("steps.judge.output.passed", "input == 'x'"), "the loop's until reads nothing"),
    (("max: MAX", "max: 11"), "at most 10 rounds"),
    (("max: MAX", "max: 0"), "greater than or equal to 1"),
    (("from: draft", "from: drafts"), "no step 'drafts'"),
])
def test_a_loop_with_no_way_to_end_does_not_load(registry, change, message):
    text = textwrap.dedent(LOOP.replace(*change).replace("MAX", "3"))
    with pytest.raises(SpecError, match=message):
        load_pipeline_text(text, "loop.yaml", registry, CATALOG)


@pytest.mark.parametrize(("change", "message"), [
    (("for_each: steps.split.chunks", "for_each: steps.split.chunk"), "gives no 'chunk'"),
    (("for_each: steps.split.chunks", "for_each: chunks"), "as steps.ID.FIELD"),
    (("for_each: steps.split.chunks\n    concurrency: CONCURRENCY\n    ", ""), "only a for_each: step has"),
])
def test_for_each_errors_are_located(registry, change, message):
    text = textwrap.dedent(MAP.replace(*change).replace("CONCURRENCY", "2").replace("ON_ERROR", "fail"))
    with pytest.raises(SpecError, match=message):
        load_pipeline_text(text, "map.yaml", registry, CATALOG)


async def test_a_replay_reuses_a_steps_output_where_its_definition_and_inputs_are_the_same(registry):
    from pipeline.context import Reusable

    engine = ScriptedEngine({"Classify": '{"intent": "tech", "amount": 0}', "Tech": "Reboot it.",
                             "Polish": "Reboot it, please."})
    text = TRIAGE + "  - {id: log, type: audit, always: true}\n"  # with an audit step, steps keep their inputs
    p = pipeline(registry, text, engine)
    first, _ = await run(p)
    kept = {r.key: Reusable(r.definition_sha256, r.inputs_sha256, r.output) for r in first.stages
            if r.status == "ok" and r.output is not None}
    assert set(kept) >= {"classify", "tech", "answer"}
    again = RequestContext.from_text(p.name, "my order never came", reuse=kept)
    submitted = len(engine.prompts)
    final = await Runner().run(p, again)
    assert final.summary.output_text == "Reboot it, please." and len(engine.prompts) == submitted  # nothing rerun
    assert {r.id for r in again.stages if r.reused} == {"classify", "tech", "answer"}
    # A changed step reruns; a step after it reruns only if what it reads changed (here the fake answers alike).
    changed = pipeline(registry, text.replace("Tech: answer.", "Tech: answer briefly."), engine)
    again = RequestContext.from_text(p.name, "my order never came", reuse=kept)
    await Runner().run(changed, again)
    assert {r.id for r in again.stages if r.reused} == {"classify", "answer"} and len(engine.prompts) == submitted + 1
    engine.replies["Tech"] = "Restart it."
    again = RequestContext.from_text(p.name, "my order never came", reuse=kept)
    await Runner().run(changed, again)
    assert {r.id for r in again.stages if r.reused} == {"classify"}  # the answer read a new tech output


async def test_a_loops_runs_are_spans_told_apart_by_item_and_round(registry):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pipeline import tracing

    exporter = InMemorySpanExporter()
    provider = tracing.make_tracer_provider("none")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        runner = Runner(provider.get_tracer("test"))
        mapped = pipeline(registry, MAP.replace("CONCURRENCY", "2").replace("ON_ERROR", "fail"), EchoEngine())
        await runner.run(mapped, RequestContext.from_text(mapped.name, text_of(3)))
        looped = pipeline(registry, LOOP.replace("MAX", "5"), JudgeEngine(passes_at=2))
        await runner.run(looped, RequestContext.from_text(looped.name, "q"))
    finally:
        provider.shutdown()
    spans = exporter.get_finished_spans()
    requests = {span.name: span.context.span_id for span in spans if span.name.startswith("pipeline ")}
    items = [span for span in spans if span.name == "stage each"]
    assert sorted(span.attributes[tracing.STAGE_ITEM] for span in items) == [0, 1, 2]
    assert {span.parent.span_id for span in items} == {requests["pipeline mapped"]}  # side by side
    rounds = sorted((span.name, span.attributes[tracing.STAGE_ROUND]) for span in spans
                    if span.name in ("stage draft", "stage judge"))
    assert rounds == [("stage draft", 1), ("stage draft", 2), ("stage judge", 1), ("stage judge", 2)]
    assert all(span.attributes[tracing.STAGE_ATTEMPT] == 1 for span in spans if span.name.startswith("stage "))
    assert tracing.STAGE_ROUND not in next(s for s in spans if s.name == "stage answer").attributes
