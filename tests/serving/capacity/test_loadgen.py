"""inferline load: the open-loop dispatcher's achieved rate, and a run against a live server over fake engines."""

from __future__ import annotations

import asyncio
import textwrap

import httpx
import pytest

from serving.capacity.loadgen import dispatch, load_server
from serving.capacity.workload import Distribution, requests_for
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.live_server import LiveServer
from tests.serving.workspaces import write_workspace

PROMPT, OUTPUT = Distribution.parse("uniform:5,20"), Distribution.parse("fixed:8")


async def test_arrivals_keep_to_their_schedule_on_a_virtual_clock():
    """On a clock that only moves when the dispatcher sleeps, each request starts exactly on time."""
    now = [0.0]

    async def sleep(seconds: float) -> None:
        await asyncio.sleep(0)  # the requests already started run first, at the time they were started
        now[0] += seconds

    started: list[float] = []

    async def send(request, origin):
        started.append(now[0] - origin)

    requests = requests_for(50.0, 200.0, PROMPT, OUTPUT, seed=1)
    tasks, _ = await dispatch(requests, send, clock=lambda: now[0], sleep=sleep)
    await asyncio.gather(*tasks)
    assert started == pytest.approx([r.arrival_s for r in requests])
    assert len(started) / 200.0 == pytest.approx(50.0, rel=0.05)


async def test_arrivals_keep_to_their_schedule_while_no_request_ever_answers():
    """Open loop: answers that never come do not hold back later arrivals. On the virtual clock (no timing in
    a test: a real-time rate check failed on a loaded 2-core machine, 334 sent of 400 a second), every request
    starts at its own arrival time although none has finished, and the window holds the target rate."""
    rate, duration = 400.0, 3.0
    now = [0.0]

    async def sleep(seconds: float) -> None:
        await asyncio.sleep(0)
        now[0] += seconds

    requests = requests_for(rate, duration, PROMPT, OUTPUT, seed=5)
    never = asyncio.Event()
    sent: list[float] = []

    async def send(request, origin):
        sent.append(now[0] - origin)
        await never.wait()  # a server that never answers

    # A dispatcher that waited for answers would never return: the timeout turns that hang into a failure.
    tasks, _ = await asyncio.wait_for(dispatch(requests, send, clock=lambda: now[0], sleep=sleep), timeout=60)
    await asyncio.sleep(0)  # let the last tasks start
    try:
        assert len(sent) == len(requests)  # every one was sent although none has been answered
        assert not any(task.done() for task in tasks)
        assert sent == pytest.approx([r.arrival_s for r in requests])
        assert sum(1 for t in sent if t <= duration) / duration == pytest.approx(rate, rel=0.05)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


CHAT = """
name: chat
slo: {ttft_ms_p95: 60000, itl_ms_p95: 60000, e2e_ms_p95: 60000}
stages:
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 64, temperature: 0}}
  - {id: out, type: stream}
"""


@pytest.fixture
def live_server(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    (tmp_path / "pipelines" / "chat.yaml").write_text(textwrap.dedent(CHAT))
    server = LiveServer(create_server(open_workspace(str(config)), engines=FakeEngines(
        smol=FakeEngine("The capital of France is Paris, a city on the Seine."))))
    yield server
    server.stop()


@pytest.mark.integration
async def test_load_against_a_live_server(live_server):
    result = await load_server(live_server.url, "chat", 20.0, 2.0, PROMPT, OUTPUT, seed=3)
    n = len(requests_for(20.0, 2.0, PROMPT, OUTPUT, seed=3))
    assert result["requests"] == n and result["completed"] == n and result["status"] == {"ok": n}
    assert result["tokens"]["output_per_request"] == 8 == result["tokens"]["output_requested_per_request"]
    assert result["finish_reasons"] == {"length": n}
    assert result["slo"]["all"] == {"judged": n, "met": n, "attainment": 1.0}
    # The server judged the same requests against the same objectives, and /metrics said so.
    assert result["server_slo"]["all"] == {"judged": n, "met": n, "attainment": 1.0}
    assert result["queue_depth"]["samples"] >= 1 and result["queue_depth"]["max"] == 0.0
    assert result["cost_usd"]["per_request"] > 0 and result["e2e_ms"]["p95"] is not None
    assert result["ttft_ms"]["p50"] <= result["e2e_ms"]["p50"]


@pytest.mark.integration
async def test_load_reports_refused_requests(live_server):
    too_long = Distribution.parse("fixed:100")  # above the pipeline's max_tokens: every request gets a 400
    result = await load_server(live_server.url, "chat", 10.0, 1.0, PROMPT, too_long, seed=2)
    assert result["completed"] == 0 and result["status"] == {"failed:400": result["requests"]}
    assert result["slo"]["all"]["attainment"] == 0.0 and "max_tokens" in result["first_errors"][0]
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        assert (await client.get("/pipelines/nope")).status_code == 404


async def test_load_reports_the_servers_engine_steps_from_metrics():
    # A real EngineMetrics registry exposed as /metrics; the load reads it before and after.
    from prometheus_client import generate_latest

    from serving.capacity.loadgen import MetricsSampler, _steps_delta
    from serving.engine.metrics import EngineMetrics

    metrics = EngineMetrics("smol")
    metrics.observe_step(0.2, num_prompt_tokens=50, num_decodes=1)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=generate_latest(metrics.registry)))
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
        sampler = MetricsSampler(client)
        before = await sampler.read("chat")
        for batch in (1, 2, 3):  # during the load
            metrics.observe_step(0.05 + 0.01 * batch, num_prompt_tokens=0, num_decodes=batch)
        metrics.observe_step(0.3, num_prompt_tokens=80, num_decodes=2)
        after = await sampler.read("chat")
    steps = _steps_delta(before, after)
    assert steps == {"decode": {"steps": 3, "mean_ms": 70.0, "mean_batch": 2.0},
                     "prefill": {"steps": 1, "mean_ms": 300.0}}
    assert _steps_delta(None, after) is None
    assert _steps_delta({}, {"inferline_num_requests_running": 0.0}) is None  # no local engine behind /metrics
