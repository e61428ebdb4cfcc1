"""Hot reload over a real runtime (fake engines): edits swap in, requests in flight finish on the version
they started with, a bad edit keeps the old version serving, new files add and deleted files retire."""

from __future__ import annotations

import textwrap

import pytest
from prometheus_client import CollectorRegistry

from pipeline.context import RequestContext
from pipeline.errors import SpecError
from pipeline.events import Done
from serving.runtime.reloader import PipelineReloader
from serving.runtime.resources import Runtime, RuntimeOptions
from serving.runtime.workspace import open_workspace
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import CHAT, write_workspace


@pytest.fixture
async def runtime(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    workspace = open_workspace(str(write_workspace(tmp_path, auth=False)))
    options = RuntimeOptions(engines=FakeEngines(smol=FakeEngine("Paris.")), record_versions=True)
    async with Runtime(workspace, workspace.load_pipelines(), options) as opened:
        yield opened


def chat_file(runtime: Runtime):
    return runtime.workspace.pipelines_dir / "chat.yaml"


def edit(path, text: str) -> None:
    path.write_text(textwrap.dedent(text))


async def ask(runtime: Runtime, name: str = "chat") -> Done:
    final = await runtime.runner.run(runtime.pipelines[name], RequestContext.from_text(name, "Capital?"))
    assert isinstance(final, Done), final
    return final


async def test_an_edit_is_swapped_in_and_recorded_as_a_version(runtime):
    reloader = PipelineReloader(runtime, registry=CollectorRegistry())
    before = runtime.pipelines["chat"]
    edit(chat_file(runtime), CHAT.replace("name: chat", "name: chat\nversion: '2'"))
    assert await reloader.reload() == ["chat"]
    after = runtime.pipelines["chat"]
    assert after is not before and after.spec.version == "2"
    assert (await ask(runtime)).summary.pipeline_version == "2"
    version = runtime.deployments.versions.by_sha256(after.loaded.sha256)
    assert version is not None and version.label == "2" and "version: '2'" in version.text
    assert [v.label for v in runtime.deployments.versions.list("chat")] == ["2", "1"]
    assert await reloader.reload() == []  # nothing changed since


async def test_requests_in_flight_finish_on_the_version_they_started_with(runtime):
    reloader = PipelineReloader(runtime, registry=CollectorRegistry())
    old = runtime.pipelines["chat"]
    closed = []
    real_close = old.aclose

    async def close() -> None:
        closed.append(old.in_flight)
        await real_close()

    old.aclose = close
    streams = [runtime.runner.stream(old, RequestContext.from_text("chat", f"q{n}")) for n in range(8)]
    for stream in streams:
        await anext(stream)  # started: the first stage is running
    assert old.in_flight == 8
    edit(chat_file(runtime), CHAT.replace("name: chat", "name: chat\nversion: '2'"))
    await reloader.reload()
    assert (await ask(runtime)).summary.pipeline_version == "2"  # a new request gets the new version
    finals = []
    for stream in streams:
        async for event in stream:
            if isinstance(event, Done):
                finals.append(event)
    assert [f.summary.pipeline_version for f in finals] == ["1"] * 8
    await reloader.aclose()
    assert closed == [0]  # closed once, after its last request ended


async def test_a_bad_edit_keeps_the_old_version_and_says_where(runtime):
    registry = CollectorRegistry()
    reloader = PipelineReloader(runtime, registry=registry)
    running = runtime.pipelines["chat"]
    edit(chat_file(runtime), CHAT.replace("type: tokenize", "type: tokenise"))
    assert await reloader.reload() == []
    assert runtime.pipelines["chat"] is running
    await ask(runtime)
    error = reloader.error_for("chat")
    assert error is not None and error.pipeline == "chat"
    issue = error.issues[0]
    assert issue.file.endswith("chat.yaml") and issue.line == 7 and "tokenise" in issue.message
    assert registry.get_sample_value("inferline_pipeline_reloads_total", {"result": "invalid"}) == 1
    edit(chat_file(runtime), "name: chat\nstages: [\n")  # not even YAML
    await reloader.reload()
    assert reloader.error_for("chat").issues[0].line >= 2 and runtime.pipelines["chat"] is running
    edit(chat_file(runtime), CHAT)  # fixed: the error goes, the pipeline is reloaded
    assert await reloader.reload() == ["chat"]
    assert reloader.errors == {} and runtime.pipelines["chat"] is not running


async def test_a_new_file_adds_and_a_deleted_file_retires(runtime):
    reloader = PipelineReloader(runtime, registry=CollectorRegistry())
    folder = runtime.workspace.pipelines_dir
    edit(folder / "second.yaml", CHAT.replace("name: chat", "name: second"))
    assert await reloader.reload() == ["second"]
    await ask(runtime, "second")
    retired = runtime.pipelines["second"]
    (folder / "second.yaml").unlink()
    assert await reloader.reload() == ["second"]
    assert "second" not in runtime.pipelines
    await reloader.aclose()
    assert retired.in_flight == 0


async def test_a_name_taken_by_another_file_is_refused(runtime):
    reloader = PipelineReloader(runtime, registry=CollectorRegistry())
    edit(runtime.workspace.pipelines_dir / "copy.yaml", CHAT)
    assert await reloader.reload() == []
    error = reloader.errors[str((runtime.workspace.pipelines_dir / "copy.yaml").resolve())]
    assert error.pipeline == "" and "already used by" in error.issues[0].message
    assert runtime.pipelines["chat"].loaded.file.endswith("chat.yaml")


@pytest.mark.parametrize("name", ["support\x00", "..", "../chat", "a" * 129, "chàt", "Chat"])
async def test_a_name_no_pipeline_may_have_never_names_a_file(runtime, name):
    reloader = PipelineReloader(runtime, registry=CollectorRegistry())
    folder = runtime.workspace.pipelines_dir
    before = sorted(folder.parent.rglob("*.y*ml"))
    for attempt in (reloader.check, lambda n, text: reloader.install(n, text, "test")):
        with pytest.raises(SpecError) as refused:
            await attempt(name, CHAT.replace("name: chat", f"name: {name!r}"))
        assert "cannot name a pipeline" in str(refused.value), refused.value
    assert sorted(folder.parent.rglob("*.y*ml")) == before
