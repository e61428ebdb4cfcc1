"""generate's ``output`` option and stream's check of the final text, against a fake engine."""

from __future__ import annotations

import textwrap

import pytest

from pipeline.context import RequestContext
from pipeline.errors import SpecError
from pipeline.events import Done, Error
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, Resources
from pipeline.runner import Pipeline, Runner
from stages.stream import check_output
from tests.fakes import FakeEngine, FakeEngines

CATALOG = Catalog(models={"smol": ModelInfo("smol")})
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}

EXTRACT = """
name: extract
stages:
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - id: gen
    type: generate
    with:
      max_tokens: 64
      temperature: 0
      output: {json_schema: {type: object, properties: {name: {type: string}}, required: [name]}}
  - {id: out, type: stream}
"""


def build(yaml_text: str, registry, engines) -> Pipeline:
    loaded = load_pipeline_text(textwrap.dedent(yaml_text), "p.yaml", registry, CATALOG)
    return Pipeline(loaded, Resources(CATALOG, engines=engines))


async def run(pipeline, ctx):
    return [event async for event in Runner().stream(pipeline, ctx)]


@pytest.mark.parametrize(("reply", "valid"), [('{"name": "Ada"}', True), ('{"nom": "Ada"}', False), ("Ada", False)])
async def test_the_constraint_reaches_the_engine_and_the_text_is_checked(registry, reply, valid):
    engines = FakeEngines(smol=FakeEngine(reply))
    ctx = RequestContext.from_text("extract", "Ada Lovelace wrote the first program.")
    await run(build(EXTRACT, registry, engines), ctx)
    _, sampling, _ = engines.engines["smol"].submitted[0]
    assert sampling.output == {"json_schema": SCHEMA}
    decision = ctx.facts["decisions"]["out"]
    assert decision["output_valid"] is valid
    assert ("error" in decision) is not valid
    assert ctx.facts["sampling"]["output"] == "json_schema"


async def test_a_caller_may_constrain_the_output_where_client_params_allow(registry):
    engines = FakeEngines(smol=FakeEngine("yes"))
    pipeline = build(EXTRACT.replace("      output: {json_schema: {type: object, properties: {name: {type: string}}, "
                                     "required: [name]}}\n", ""), registry, engines)
    ctx = RequestContext.from_text("extract", "Is it?", params={"output": {"choice": ["yes", "no"]}})
    await run(pipeline, ctx)
    assert engines.engines["smol"].submitted[0][1].output == {"choice": ["yes", "no"]}
    assert ctx.facts["decisions"]["out"] == {"output_valid": True}


async def test_a_callers_output_does_not_replace_the_pipelines_own(registry):
    engines = FakeEngines(smol=FakeEngine('{"name": "Ada"}'))
    ctx = RequestContext.from_text("extract", "Is it?", params={"output": {"choice": ["yes", "no"]}})
    final = await Runner().run(build(EXTRACT, registry, engines), ctx)
    assert isinstance(final, Error) and final.kind == "invalid_input" and final.stage_id == "gen"
    assert "has its own output constraint (json_schema)" in final.message
    assert "caller_may_override: true" in final.message
    assert not engines.engines["smol"].submitted


async def test_a_pipeline_may_let_callers_override_its_output(registry):
    engines = FakeEngines(smol=FakeEngine("yes"))
    yaml_text = EXTRACT.replace("required: [name]}}", "required: [name]}, caller_may_override: true}")
    pipeline = build(yaml_text, registry, engines)
    ctx = RequestContext.from_text("extract", "Is it?", params={"output": {"choice": ["yes", "no"]}})
    assert isinstance(await Runner().run(pipeline, ctx), Done)
    assert engines.engines["smol"].submitted[0][1].output == {"choice": ["yes", "no"]}
    await Runner().run(pipeline, RequestContext.from_text("extract", "Ada."))  # no caller output: its own
    assert engines.engines["smol"].submitted[1][1].output == {"json_schema": SCHEMA}
    flagged = RequestContext.from_text("extract", "Is it?", params={  # the flag is the pipeline's, not a caller's
        "output": {"choice": ["yes", "no"], "caller_may_override": True}})
    final = await Runner().run(pipeline, flagged)
    assert isinstance(final, Error) and "caller_may_override" in final.message


def test_caller_may_override_needs_callers_to_be_allowed_output(registry):
    yaml_text = EXTRACT.replace("required: [name]}}", "required: [name]}, caller_may_override: true}").replace(
        "temperature: 0\n", "temperature: 0\n      client_params: [max_tokens]\n")
    with pytest.raises(SpecError, match=r"p.yaml:\d+:\d+: stages\[2\].with.output.caller_may_override: callers "
                                        r"cannot set output: add 'output' to client_params"):
        build(yaml_text, registry, FakeEngines())


async def test_two_kinds_at_once_are_refused(registry):
    bad = EXTRACT.replace("output: {json_schema:", "output: {regex: 'a+', json_schema:")
    with pytest.raises(SpecError, match="exactly one of json_schema, regex or choice"):
        build(bad, registry, FakeEngines())


def load_errors(yaml_text: str, registry, catalog: Catalog = CATALOG) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_pipeline_text(textwrap.dedent(yaml_text), "p.yaml", registry, catalog)
    return [str(issue) for issue in info.value.issues]


def test_a_broken_schema_is_a_located_load_error(registry):
    found = load_errors("""
        name: extract
        stages:
          - {id: prompt, type: prompt}
          - {id: tok, type: tokenize}
          - id: gen
            type: generate
            with:
              output:
                json_schema:
                  type: object
                  properties:
                    age: {type: numbr}
                  required: name
          - {id: out, type: stream}
        """, registry)
    assert found == [
        "p.yaml:13:25: stages[2].with.output.json_schema.properties.age.type: unknown JSON Schema type 'numbr'; "
        "did you mean 'number'? (types: array, boolean, integer, null, number, object, string)",
        "p.yaml:14:21: stages[2].with.output.json_schema.required: not a valid JSON Schema: 'name' is not of type "
        "'array'",
    ]


def test_other_schema_errors_name_the_keyword(registry):
    found = load_errors(EXTRACT.replace("required: [name]", "required: name"), registry)
    assert found == ["p.yaml:11:90: stages[2].with.output.json_schema.required: not a valid JSON Schema: 'name' "
                     "is not of type 'array'"]


def refuse_look_around(kind: str, value) -> str | None:
    """A stand-in for the engines' compile check (serving wires in serving/engine/constraints.compile_error)."""
    return "look-around is not supported" if kind == "regex" and "(?<" in value else None


def test_the_engines_compile_check_runs_at_load(registry):
    catalog = Catalog(models=CATALOG.models, check_output=refuse_look_around)
    bad = EXTRACT.replace("output: {json_schema: {type: object, properties: {name: {type: string}}, required: [name]}}",
                          "output: {regex: '(?<=x)y'}")
    assert load_errors(bad, registry, catalog) == [
        "p.yaml:11:23: stages[2].with.output.regex: constrained decoding cannot compile it: look-around is not "
        "supported"]
    good = bad.replace("(?<=x)y", "x+y")
    assert load_pipeline_text(textwrap.dedent(good), "p.yaml", registry, catalog).spec.name == "extract"


def test_output_errors_come_with_the_files_other_errors(registry):
    found = load_errors(EXTRACT.replace("name: extract", "name: extract\naccess: {roles: [callers]}")
                        .replace("{type: string}}", "{type: strng}}"), registry)
    assert [f.split(": ", 2)[1] for f in found] == ["access.roles[0]", "stages[2].with.output.json_schema.properties"
                                                                        ".name.type"]


def test_check_output():
    assert check_output('{"name": "Ada"}', {"json_schema": SCHEMA}) is None
    assert "name" in check_output("{}", {"json_schema": SCHEMA})
    assert check_output("2026-11-30", {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}) is None
    assert check_output("30/11/2026", {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}) is not None
    assert check_output("no", {"choice": ["yes", "no"]}) is None
    assert check_output("maybe", {"choice": ["yes", "no"]}) is not None


class ChangingEngine(FakeEngine):
    """Answers with each of *replies* in turn (a backend that does not enforce the constraint)."""

    def __init__(self, *replies: str):
        super().__init__(replies[0])
        self.replies = [r.encode() for r in replies]

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        self.reply = self.replies[min(len(self.submitted), len(self.replies) - 1)]
        return await super().submit(prompt_ids, sampling, cache_salt, hints=hints)


@pytest.mark.parametrize(("retries", "replies", "submissions", "valid"), [
    (2, ["not json", '{"nom": 1}', '{"name": "Ada"}'], 3, True),  # the third try matches
    (1, ["not json", '{"nom": 1}', '{"name": "Ada"}'], 2, False),  # out of tries: the last answer stands
    (2, ['{"name": "Ada"}'], 1, True),  # right the first time: no retry
])
async def test_retry_invalid_generates_again_and_sends_only_the_checked_text(registry, retries, replies,
                                                                             submissions, valid):
    from pipeline.events import TextDelta

    engines = FakeEngines(smol=ChangingEngine(*replies))
    stream = f"{{id: out, type: stream, with: {{retry_invalid: {retries}}}}}"
    yaml_text = EXTRACT.replace("{id: out, type: stream}", stream)
    ctx = RequestContext.from_text("extract", "Ada Lovelace.")
    events = await run(build(yaml_text, registry, engines), ctx)
    assert len(engines.engines["smol"].submitted) == submissions
    sent = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert sent == ctx.output_text == replies[submissions - 1]  # only the answer that stands reaches the client
    assert ctx.facts["decisions"]["out"]["output_valid"] is valid
