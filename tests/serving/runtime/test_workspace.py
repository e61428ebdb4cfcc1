"""The workspace: a server config, its registry and its pipelines folder, loaded as serve loads them."""

from __future__ import annotations

import pytest

from pipeline.errors import SpecError
from serving.runtime.workspace import open_workspace


def test_load_all_refuses_two_pipelines_of_one_name_naming_both(tmp_path):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "a.yaml").write_text("name: support\nstages: [{id: p, type: prompt}]\n")
    (folder / "b.yaml").write_text("stages: [{id: p, type: prompt}]\nname: support\n")
    (tmp_path / "inferline.yaml").write_text("pipelines: pipelines/\n")
    workspace = open_workspace(str(tmp_path / "inferline.yaml"))
    with pytest.raises(SpecError) as info:
        workspace.load_pipelines()
    assert [str(issue) for issue in info.value.issues] == [
        f"{folder / 'b.yaml'}:2:7: name: pipeline name 'support' is already used by {folder / 'a.yaml'}:1:7; "
        "give each pipeline its own name (it is its endpoint, /pipelines/support)"]


def test_load_all_compiles_each_pipelines_output(tmp_path):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "a.yaml").write_text(
        "name: a\nstages:\n  - {id: prompt, type: prompt}\n  - {id: tok, type: tokenize}\n"
        "  - {id: gen, type: generate, with: {output: {json_schema: {type: array, uniqueItems: true}}}}\n"
        "  - {id: out, type: stream}\n")
    (tmp_path / "inferline.yaml").write_text("models: {smol: {source: models/x}}\npipelines: pipelines/\n")
    with pytest.raises(SpecError, match=r"a.yaml:5:60: stages\[2\].with.output.json_schema: constrained decoding "
                                        r"cannot compile it: Unimplemented keys: \[\"uniqueItems\"\]"):
        open_workspace(str(tmp_path / "inferline.yaml")).load_pipelines()
