"""Priority, tenant and deadline from the pipeline file to the engine, and a passed deadline to HTTP.

The HTTP test runs the real path below the app: generate → failover → LocalEngine → AsyncEngine →
Scheduler, with a stub in place of the model (tests/serving/engine/test_scheduler_policy.py).
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest
from litestar.testing import TestClient

from pipeline.context import Principal, RequestContext
from pipeline.errors import DeadlineExceeded, SpecError
from pipeline.events import Error
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, ModelOccupancy, Resources, SchedulingHints
from pipeline.runner import Pipeline, Runner
from serving.backends.local_engine import LocalEngine
from serving.engine.async_engine import AsyncEngine
from serving.engine.sampling_params import SamplingParams
from serving.http.problems import from_error
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngines
from tests.serving.engine.test_scheduler_policy import StubEngine, contended

CATALOG = Catalog(models={"smol": ModelInfo("smol")})

BATCH = """
name: nightly
stages:
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 8, priority: batch, queue_timeout_ms: 1500}}
  - {id: out, type: stream}
"""

SERVER = """
models:
  smol: {{source: models/smollm2-135m-instruct}}
database: sqlite:///{db}
pipelines: pipelines/
auth: {{enabled: false}}
"""


def build(yaml_text: str, registry, engines) -> Pipeline:
    loaded = load_pipeline_text(textwrap.dedent(yaml_text), "p.yaml", registry, CATALOG)
    return Pipeline(loaded, Resources(CATALOG, engines=engines))


async def test_generate_hands_the_engine_the_pipelines_class_the_tenant_and_a_deadline(registry):
    engines = FakeEngines()
    ctx = RequestContext.from_text("nightly", "hi", principal=Principal("k", "caller", "acme"))
    before = time.perf_counter()
    events = [event async for event in Runner().stream(build(BATCH, registry, engines), ctx)]
    assert not any(isinstance(e, Error) for e in events)
    hints = engines.engines["smol"].hints[0]
    assert (hints.priority, hints.tenant) == ("batch", "acme")
    assert before + 1.5 <= hints.deadline_s <= time.perf_counter() + 1.5


async def test_by_default_a_request_is_interactive_and_waits_as_long_as_it_takes(registry):
    engines = FakeEngines()
    await Runner().run(build(BATCH.replace(", priority: batch, queue_timeout_ms: 1500", ""), registry, engines),
                       RequestContext.from_text("nightly", "hi"))
    assert engines.engines["smol"].hints == [SchedulingHints("interactive", "", None)]


@pytest.mark.parametrize(("option", "needle"), [("priority: urgent", "priority"),
                                                ("queue_timeout_ms: 0", "queue_timeout_ms")])
def test_bad_scheduling_options_are_load_errors(registry, option, needle):
    with pytest.raises(SpecError, match=needle):
        build(BATCH.replace("priority: batch", option), registry, FakeEngines())


def test_a_passed_deadline_is_a_503_problem_that_says_so():
    problem = from_error(DeadlineExceeded("model 'smol': dropped before prefill"))
    assert (problem.status, problem.title, problem.kind) == (503, "Queue deadline passed", "deadline_exceeded")


class BusyModel:
    """An EngineProvider with one LocalEngine whose only slot a long request holds.

    Started on first use, inside the app's event loop (the engine delivers tokens to the loop that
    started it).
    """

    default_model = "smol"

    def __init__(self):
        self.async_engine = AsyncEngine(engine=StubEngine(contended()))  # type: ignore[arg-type]
        self.local: LocalEngine | None = None

    async def get(self, name: str) -> LocalEngine:
        if self.local is None:
            await self.async_engine.start()
            self.hog = await self.async_engine.submit([1, 2, 3], SamplingParams(max_tokens=10**6, ignore_eos=True))
            await self.hog.__anext__()  # it runs: nobody else is admitted until it ends
            self.local = LocalEngine("smol", self.async_engine, "0" * 64)
        return self.local

    def occupancy(self, name: str) -> ModelOccupancy:
        return self.local.occupancy() if self.local else ModelOccupancy()

    async def close(self) -> None:
        await self.async_engine.shutdown()


class ByteChat:
    """Just enough of a transformers tokenizer for LocalEngine's HFTokenizer."""

    eos_token_id = None

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return list(messages[-1]["content"].encode())

    def decode(self, token_ids, skip_special_tokens=True):
        return bytes(token_ids).decode(errors="replace")


def test_a_request_still_queued_at_its_deadline_gets_a_clear_503(tmp_path: Path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "nightly.yaml").write_text(
        textwrap.dedent(BATCH).replace("queue_timeout_ms: 1500", "queue_timeout_ms: 30"))
    (tmp_path / "inferline.yaml").write_text(SERVER.format(db=tmp_path / "app.db"))
    provider = BusyModel()
    provider.async_engine._engine.tokenizer = ByteChat()  # type: ignore[union-attr]
    with TestClient(create_server(open_workspace(str(tmp_path / "inferline.yaml")), engines=provider)) as client:
        try:
            response = client.post("/pipelines/nightly", json={"input": "summarize this"})
            assert response.status_code == 503, response.text
            assert response.headers["content-type"].startswith("application/problem+json")
            body = response.json()
            assert body["type"].endswith("/deadline_exceeded") and body["title"] == "Queue deadline passed"
            assert "model 'smol'" in body["detail"] and "dropped before prefill" in body["detail"]
            assert provider.async_engine.engine.scheduler.num_running == 1  # the running one goes on
        finally:
            client.blocking_portal.call(provider.close)
