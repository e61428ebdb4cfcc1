"""The one runtime: a pipeline runs over what it opens, and everything it opened is closed, even when
one close raises."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from pipeline.context import RequestContext
from pipeline.events import Done
from serving.backends.audit_sink import StoreSink
from serving.runtime import resources
from serving.runtime.resources import Runtime, RuntimeOptions
from serving.runtime.workspace import open_workspace
from store.counters import SqlCounters
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import write_workspace


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    return open_workspace(str(write_workspace(tmp_path, auth=False)))


def runtime_of(workspace) -> Runtime:
    engines = FakeEngines(smol=FakeEngine("Paris."))
    return Runtime(workspace, workspace.load_pipelines(), RuntimeOptions(engines=engines))


async def test_a_pipeline_runs_over_the_runtime_and_is_audited(workspace):
    async with runtime_of(workspace) as runtime:
        final = await runtime.runner.run(runtime.pipelines["chat"], RequestContext.from_text("chat", "Capital?"))
        assert isinstance(final, Done)
        assert await runtime.audit_sink.flushed(5)
        with runtime.db.connect() as connection:
            assert connection.execute(sa.text("select count(*) from audit_records")).scalar() == 1


async def test_every_resource_is_closed_when_one_close_raises(workspace, monkeypatch):
    closed: list[str] = []

    def recording(name: str, close):
        async def close_async(*args) -> None:
            closed.append(name)
            await close(*args)

        return close_async

    async def counters_close(self) -> None:
        closed.append("counters")
        raise RuntimeError("the counters' close failed")

    monkeypatch.setattr(SqlCounters, "close", counters_close)
    monkeypatch.setattr(StoreSink, "aclose", recording("audit sink", StoreSink.aclose))
    real_open_engine, real_tracer = resources.open_engine, resources.make_tracer_provider

    def open_engine(url):
        engine = real_open_engine(url)
        dispose = engine.dispose
        monkeypatch.setattr(engine, "dispose", lambda: (closed.append("database"), dispose()))
        return engine

    def make_tracer_provider(*args):
        provider = real_tracer(*args)
        shutdown = provider.shutdown
        monkeypatch.setattr(provider, "shutdown", lambda: (closed.append("tracer"), shutdown()))
        return provider

    monkeypatch.setattr(resources, "open_engine", open_engine)
    monkeypatch.setattr(resources, "make_tracer_provider", make_tracer_provider)
    runtime = runtime_of(workspace)
    for name, pipeline in runtime.pipelines.items():
        monkeypatch.setattr(pipeline, "aclose", recording(f"pipeline {name}", pipeline.aclose))
    monkeypatch.setattr(runtime.pool, "close", recording("model pool", runtime.pool.close))
    with pytest.raises(RuntimeError, match="the counters' close failed"):
        async with runtime:
            pass
    # Newest first; the counters' close raised, and what was opened before them is closed all the same.
    assert closed == ["model pool", "pipeline reviews", "pipeline chat", "counters", "audit sink", "database",
                      "tracer"]


async def test_a_failure_while_opening_closes_what_was_opened(workspace, monkeypatch):
    async def refused(spec, db):
        raise ConnectionError("no counters")

    monkeypatch.setattr(resources, "open_counters", refused)
    runtime = runtime_of(workspace)
    disposed = []
    real_open_engine = resources.open_engine

    def open_engine(url):
        engine = real_open_engine(url)
        monkeypatch.setattr(engine, "dispose", lambda: disposed.append(True))
        return engine

    monkeypatch.setattr(resources, "open_engine", open_engine)
    with pytest.raises(ConnectionError):
        await runtime.__aenter__()
    assert disposed == [True]
    # Closed: it may be opened again.
    monkeypatch.undo()
    async with runtime:
        assert runtime.db is not None


async def test_a_runtime_opens_once_at_a_time(workspace):
    async with runtime_of(workspace) as runtime:
        with pytest.raises(RuntimeError, match="open already"):
            await runtime.__aenter__()
