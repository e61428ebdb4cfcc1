"""Stage registration: built-ins, entry points and the operator's plugins: list."""

from __future__ import annotations

import textwrap

import pytest

from pipeline.errors import PluginError
from pipeline.loader import load_pipeline_text
from pipeline.registry import StageRegistry
from pipeline.stage import Stage
from stages import register_builtins

PLUGIN_MODULE = '''
from pipeline.stage import Stage

class ShoutStage(Stage):
    type_name = "shout"
    reads = frozenset({"input"})
    writes = frozenset({"output_text"})

    async def run(self, ctx, scope):
        ctx.output_text = ctx.input.upper()
        await scope.emit_text(ctx.output_text)

def register(registry):
    registry.register(ShoutStage)
'''


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "shoutplugin.py").write_text(PLUGIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_builtins_register_by_short_name():
    registry = register_builtins(StageRegistry())
    assert "prompt" in registry.names()
    assert registry.providers("messages") == ["prompt"]


def test_plugin_module_with_register_function(plugin_dir):
    registry = StageRegistry()
    registry.load_plugins(["shoutplugin"])
    assert registry.names() == ["shout"]
    loaded = load_pipeline_text("name: p\nstages: [{id: s, type: shout}]\n", "p.yaml", registry)
    assert loaded.plans[0].cls.__name__ == "ShoutStage"


def test_plugin_module_and_class(plugin_dir):
    registry = StageRegistry()
    registry.load_plugins(["shoutplugin:ShoutStage"])
    assert registry.get("shout").__name__ == "ShoutStage"


def test_entry_point(plugin_dir):
    dist = plugin_dir / "shoutplugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shoutplugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[inferline.stages]\nyell = shoutplugin:ShoutStage\n")
    registry = StageRegistry()
    registry.load_entry_points()
    assert registry.get("yell").__name__ == "ShoutStage"


@pytest.mark.parametrize(("plugin", "message"), [
    ("no_such_module_xyz", "cannot import 'no_such_module_xyz'"),
    ("shoutplugin:Missing", "module 'shoutplugin' has no 'Missing'"),
    ("json", "module has no register"),
    ("json:dumps", "is not a subclass of pipeline.stage.Stage"),
])
def test_bad_plugins_fail_clearly(plugin_dir, plugin, message):
    with pytest.raises(PluginError, match=message):
        StageRegistry().load_plugins([plugin])


def test_conflicting_and_invalid_registrations():
    registry = register_builtins(StageRegistry())

    class Other(Stage):
        type_name = "prompt"

    with pytest.raises(PluginError, match="already registered"):
        registry.register(Other)

    class BadFields(Stage):
        type_name = "bad"
        reads = frozenset({"nonsense"})

    with pytest.raises(PluginError, match="unknown context fields"):
        registry.register(BadFields)


def test_data_flow_names_providers(registry):
    from pipeline.errors import SpecError

    with pytest.raises(SpecError) as info:
        load_pipeline_text(textwrap.dedent("""\
            name: p
            stages:
              - {id: use, type: needs-tokens}
        """), "p.yaml", registry)
    assert str(info.value.issues[0]) == (
        "p.yaml:3:21: stages[0].type: stage 'use' (needs-tokens) reads 'prompt_ids' (list[int]), which no "
        "earlier stage writes; add a stage of type tokenize or tokenize-fake before it")


def test_data_flow_suggests_moving_a_later_writer(registry):
    from pipeline.errors import SpecError

    with pytest.raises(SpecError) as info:
        load_pipeline_text(textwrap.dedent("""\
            name: p
            stages:
              - {id: prompt, type: prompt, with: {system: "{{ documents | length }} sources"}}
              - {id: find, type: search, with: {index: handbook}}
              - {id: late, type: record, when: "prompt_tokens > 3"}
        """), "p.yaml", registry, _catalog())
    assert [str(i) for i in info.value.issues] == [
        "p.yaml:3:24: stages[0].type: stage 'prompt' (prompt) reads 'documents' (list[Document]), which no "
        "earlier stage writes; stage 'find' (search) writes it: move it before 'prompt'",
        "p.yaml:5:36: stages[2].when: stage 'late' (record) reads 'prompt_tokens' (int), which no earlier "
        "stage writes; add a stage of type route or tokenize or tokenize-fake before it",
    ]


def test_data_flow_accepts_a_well_ordered_pipeline(registry):
    loaded = load_pipeline_text(textwrap.dedent("""\
        name: p
        stages:
          - {id: find, type: search, with: {index: handbook}}
          - {id: prompt, type: prompt, with: {system: "{{ documents | length }} sources"}}
          - {id: tok, type: tokenize-fake}
          - {id: use, type: needs-tokens, when: "prompt_tokens > 3"}
    """), "p.yaml", registry, _catalog())
    assert len(loaded.plans) == 4


def _catalog():
    from pipeline.protocols import Catalog

    return Catalog(indexes=frozenset({"handbook"}))
