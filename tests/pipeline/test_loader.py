"""Loading pipelines: every kind of bad YAML names its exact line and column."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pipeline.errors import SpecError
from pipeline.loader import dump_pipeline, load_pipeline, load_pipeline_text
from pipeline.registry import StageRegistry
from pipeline.spec import ROLES
from store.keys import ROLES as KEY_ROLES

GOOD = """\
name: support
description: Answers questions.
access: {roles: [caller, admin]}
stages:
  - id: find
    type: search
    with: {index: handbook, top_k: 2}
  - id: pick
    type: pick
    with: {default: smol, fallback: [big]}
    when: "role == 'admin' and tags.tier in ['gold', 'silver']"
  - id: prompt
    type: prompt
    with:
      system: "Use the sources."
  - id: log
    type: record
    always: true
    on_error: skip
    timeout_s: 2.5
"""


def errors(text: str, registry: StageRegistry, catalog=None) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_pipeline_text(textwrap.dedent(text), "p.yaml", registry, catalog)
    return [str(issue) for issue in info.value.issues]


def test_good_pipeline_loads(registry, catalog):
    loaded = load_pipeline_text(GOOD, "p.yaml", registry, catalog)
    assert [p.spec.id for p in loaded.plans] == ["find", "pick", "prompt", "log"]
    assert loaded.plans[0].config.top_k == 2
    assert loaded.plans[1].when is not None and loaded.plans[1].when.names == {"role", "tags"}
    assert loaded.spec.access.roles == ["caller", "admin"]
    assert len(loaded.sha256) == 64


def test_round_trip(registry, catalog):
    first = load_pipeline_text(GOOD, "p.yaml", registry, catalog)
    second = load_pipeline_text(dump_pipeline(first.spec), "p.yaml", registry, catalog)
    assert second.spec == first.spec
    assert dump_pipeline(second.spec) == dump_pipeline(first.spec)


# Each case: YAML text and the exact first error line it must produce.
BAD = {
    "yaml syntax: unclosed flow mapping": (
        """\
        name: x
        stages:
          - {id: a, type: record
        """,
        "p.yaml:4:1: YAML syntax error: expected ',' or '}', but got '<stream end>' "
        "(while parsing a flow mapping)"),
    "yaml syntax: tab indentation": (
        "name: x\nstages:\n\t- id: a\n",
        "p.yaml:3:1: YAML syntax error: found character '\\t' that cannot start any token"),
    "duplicate key": (
        """\
        name: x
        stages:
          - id: a
            type: record
            type: prompt
        """,
        "p.yaml:5:5: stages[0].type: duplicate key 'type' (first defined on line 4)"),
    "empty file": ("", "p.yaml:1:1: the file is empty; a pipeline is a mapping with at least 'name:' and 'stages:'"),
    "top level is a list": (
        "- name: x\n",
        "p.yaml:1:1: the top level is a list; a pipeline is a mapping with at least 'name:' and 'stages:'"),
    "unknown top-level key with suggestion": (
        """\
        name: x
        descripton: typo
        stages: [{id: a, type: record}]
        """,
        "p.yaml:2:1: descripton: unknown key 'descripton'; did you mean 'description'? "
        "(allowed: name, description, version, access, slo, stages)"),
    "missing stages": ("name: x\n", "p.yaml:1:1: stages: missing required key 'stages'"),
    "bad name pattern": (
        "name: My Pipeline\nstages: [{id: a, type: record}]\n",
        "p.yaml:1:7: name: 'My Pipeline' is not a valid name: use lowercase letters, digits, '-' "
        "and '_', starting with a letter"),
    # A pipeline's name is its file's name and the audit log's pipeline column: at most 128 characters.
    "name too long": ("name: " + "a" * 129 + "\nstages: [{id: a, type: record}]\n",
                      "p.yaml:1:7: name: string should have at most 128 characters"),
    "unknown stage type with suggestion": (
        """\
        name: x
        stages:
          - id: a
            type: recrod
        """,
        "p.yaml:4:11: stages[0].type: unknown stage type 'recrod'; did you mean 'record'? (registered: "),
    "wrong type in with: (the issue's example)": (
        """\
        name: x
        stages:
          - id: find
            type: search
            with:
              index: handbook
              top_k: ten
        """,
        "p.yaml:7:14: stages[0].with.top_k: expected an integer, got 'ten'"),
    "unknown key in with:": (
        """\
        name: x
        stages:
          - id: a
            type: record
            with: {nte: hi}
        """,
        "p.yaml:5:12: stages[0].with.nte: unknown key 'nte'; did you mean 'note'? "
        "(allowed: note, delay_s, cost_usd)"),
    "bad on_error literal": (
        """\
        name: x
        stages:
          - id: a
            type: record
            on_error: ignore
        """,
        "p.yaml:5:15: stages[0].on_error: expected one of 'fail' or 'skip', got 'ignore'"),
    "negative timeout": (
        """\
        name: x
        stages:
          - id: a
            type: record
            timeout_s: -1
        """,
        "p.yaml:5:16: stages[0].timeout_s: should be greater than 0, got -1"),
    "duplicate stage id": (
        """\
        name: x
        stages:
          - {id: a, type: record}
          - {id: a, type: record}
        """,
        "p.yaml:4:10: stages[1].id: duplicate stage id 'a' (first used by stages[0]); stage ids must be unique"),
    "unknown model": (
        """\
        name: x
        stages:
          - id: pick
            type: pick
            with: {default: bgi}
        """,
        "p.yaml:5:21: stages[0].with.default: unknown model 'bgi'; did you mean 'big'? "
        "(models in inferline.yaml: big, smol)"),
    "unknown model in a list": (
        """\
        name: x
        stages:
          - id: pick
            type: pick
            with:
              default: smol
              fallback: [big, remote]
        """,
        "p.yaml:7:23: stages[0].with.fallback[1]: unknown model 'remote' (models in inferline.yaml: big, smol)"),
    "unknown index": (
        """\
        name: x
        stages:
          - id: find
            type: search
            with: {index: handbok}
        """,
        "p.yaml:5:19: stages[0].with.index: unknown index 'handbok'; did you mean 'handbook'? "
        "(indexes in inferline.yaml: handbook)"),
    "bad when syntax, column inside the expression": (
        """\
        name: x
        stages:
          - id: a
            type: record
            when: "role == "
        """,
        "p.yaml:5:19: stages[0].when: bad expression: the expression ends too early: something must follow '=='"),
    "when calls a function": (
        """\
        name: x
        stages:
          - id: a
            type: record
            when: __import__('os').system('true')
        """,
        "p.yaml:5:11: stages[0].when: bad expression: calling a function is not allowed; use comparisons, "
        "and/or/not and 'in'"),
    "when names an unknown field": (
        """\
        name: x
        stages:
          - id: a
            type: record
            when: "promt_tokens > 10"
        """,
        "p.yaml:5:12: stages[0].when: bad expression: unknown field 'promt_tokens' in expression; "
        "did you mean 'prompt_tokens'?"),
    "when compares a number with a string": (
        """\
        name: x
        stages:
          - id: a
            type: record
            when: "prompt_tokens > '5'"
        """,
        "p.yaml:5:28: stages[0].when: bad expression: prompt_tokens is a number and '5' is a string: > cannot "
        "compare them; write 5 (without quotes) to compare numbers"),
    "when assigns with =": (
        """\
        name: x
        stages:
          - id: a
            type: record
            when: role = 'admin'
        """,
        "p.yaml:5:16: stages[0].when: bad expression: use == to compare instead of ="),
    "when uses &&": (
        """\
        name: x
        stages:
          - id: a
            type: record
            when: "role == 'admin' && tags.tier == 'gold'"
        """,
        "p.yaml:5:28: stages[0].when: bad expression: use and instead of &&"),
    "when uses ||": (
        """\
        name: x
        stages:
          - id: a
            type: record
            when: "role == 'admin' || tags.tier == 'gold'"
        """,
        "p.yaml:5:28: stages[0].when: bad expression: use or instead of ||"),
    "when uses !": (
        """\
        name: x
        stages:
          - id: a
            type: record
            when: "!documents"
        """,
        "p.yaml:5:12: stages[0].when: bad expression: use not instead of !"),
    "when compares with an unquoted word": (
        """\
        name: x
        stages:
          - id: a
            type: record
            when: role == admin
        """,
        "p.yaml:5:19: stages[0].when: bad expression: unknown field 'admin' in expression; quote strings: 'admin'"),
    "when uses is": (
        """\
        name: x
        stages:
          - id: a
            type: record
            when: role is null
        """,
        "p.yaml:5:11: stages[0].when: bad expression: use == instead of is"),
    "a route rule's when: is checked, at its column": (
        """\
        name: x
        stages:
          - id: pick
            type: route
            with:
              rules: [{when: "prompt_tokens > '1500'", model: big}]
        """,
        "p.yaml:6:39: stages[0].with.rules[0].when: bad expression: prompt_tokens is a number and '1500' is a "
        "string: > cannot compare them; write 1500 (without quotes) to compare numbers"),
    "no stages": (
        "name: x\nstages: []\n",
        "p.yaml:2:9: stages: a pipeline needs at least one stage, e.g. stages: [{id: prompt, type: prompt}]"),
    "unknown role": (
        "name: x\naccess: {roles: [callers]}\nstages: [{id: a, type: record}]\n",
        "p.yaml:2:18: access.roles[0]: unknown role 'callers'; did you mean 'caller'? (roles: caller, auditor, admin)"),
    "template names an unknown field": (
        """\
        name: x
        stages:
          - id: p
            type: prompt
            with:
              system: "Hello {{ usr }}"
        """,
        "p.yaml:6:15: stages[0].with.system: template names unknown field 'usr' (fields: "),
    "template syntax error": (
        """\
        name: x
        stages:
          - id: p
            type: prompt
            with: {user: "{% if input %}no end"}
        """,
        "p.yaml:5:11: stages[0].with: template syntax error on its line 1: Unexpected end of template."),
    "a template attribute the sandbox refuses at every request": (
        """\
        name: x
        stages:
          - id: p
            type: prompt
            with: {system: "{{ cycler.__init__.__globals__ }}"}
        """,
        "p.yaml:5:11: stages[0].with: template line 1: '__init__', '__globals__': an attribute that starts with "
        "'_' is refused by the sandbox at every request"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_yaml_is_located(case, registry, catalog):
    text, expected = BAD[case]
    found = errors(text, registry, catalog)
    assert found[0].startswith(expected), found


def test_all_errors_of_a_file_are_reported_together(registry, catalog):
    found = errors(
        """\
        name: x
        stages:
          - {id: a, type: recrod}
          - {id: a, type: search, with: {index: nope}}
          - {id: b, type: record, on_error: maybe}
        """, registry, catalog)
    assert [f.split(":", 3)[1:3] for f in found] == [["3", "19"], ["4", "10"], ["4", "41"], ["5", "37"]]


def test_type_from_a_pipeline_never_imports(registry, tmp_path, monkeypatch):
    marker = tmp_path / "evil.py"
    marker.write_text("import pathlib; pathlib.Path(__file__).with_name('ran').touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = errors("name: x\nstages: [{id: a, type: 'evil:Thing'}]\n", registry)
    assert "unknown stage type 'evil:Thing'" in found[0]
    assert not (tmp_path / "ran").exists()


def test_load_pipeline_reads_files(tmp_path, registry, catalog):
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    assert load_pipeline(path, registry, catalog).file == str(path)


def test_pipeline_roles_are_the_key_roles():
    # pipeline/ and store/ import nothing of ours, so each declares the roles; they must stay one list.
    assert ROLES == KEY_ROLES


def test_the_schema_line_leaves_error_positions_exact(registry):
    # Every example opens with `# yaml-language-server: $schema=...`: an error below it still names its own line.
    text = (Path(__file__).parents[2] / "pipelines" / "hello.yaml").read_text(encoding="utf-8")
    assert text.startswith("# yaml-language-server: $schema=")
    lines = text.replace("    type: prompt", "    type: promtp").splitlines(keepends=True)
    row = next(i for i, line in enumerate(lines) if "promtp" in line)
    with pytest.raises(SpecError) as info:
        load_pipeline_text("".join(lines), "hello.yaml", registry)
    assert str(info.value.issues[0]).startswith(f"hello.yaml:{row + 1}:{lines[row].index('promtp') + 1}: "
                                                "stages[0].type: unknown stage type 'promtp'")


def test_yaml_booleans_are_true_and_false_only():
    # YAML 1.1 read on, off, yes and no as booleans: `retry: {on: [error]}` had the key True. Editors speak 1.2.
    from pipeline.yamlsrc import parse

    src, issues = parse("x.yaml", "on: [error]\nno: NO\nyes: true\noff: False\n")
    assert not issues and src is not None
    assert src.data == {"on": ["error"], "no": "NO", "yes": True, "off": False}
