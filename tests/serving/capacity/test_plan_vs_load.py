"""plan against load, in short: a live server whose engine is the real scheduler over a step-time formula
(tests/serving/modelled_engine.py), profiled, planned and loaded at two rates. The attainment plan predicts
is within 10 points of what load measures. The real model on this machine: bench/plan_vs_load.py."""

from __future__ import annotations

import textwrap

import pytest

from pipeline.spec import SLOSpec
from serving.capacity.loadgen import load_server
from serving.capacity.planner import EngineShape, plan_rate
from serving.capacity.step_profile import StepModel, profile_engine
from serving.capacity.workload import Distribution, requests_for
from serving.engine.heap import freeze_startup_heap, thaw
from serving.engine.sampling_params import SamplingParams
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngines
from tests.serving.live_server import LiveServer
from tests.serving.modelled_engine import ModelledEngine, VirtualClock
from tests.serving.workspaces import write_workspace

pytestmark = pytest.mark.integration

SLO = SLOSpec(ttft_ms_p95=200, itl_ms_p95=50, e2e_ms_p95=1200)
CHAT = f"""
name: chat
slo: {SLO.model_dump_json(exclude_none=True)}
stages:
  - {{id: prompt, type: prompt}}
  - {{id: tok, type: tokenize}}
  - {{id: gen, type: generate, with: {{max_tokens: 64, temperature: 0}}}}
  - {{id: out, type: stream}}
"""
PROMPT, OUTPUT = Distribution.parse("uniform:20,60"), Distribution.parse("fixed:16")
#: '<user>' that the fake tokenizer's chat encoding puts before the message, one token per byte.
CHAT_OVERHEAD_TOKENS = 6


def step_ms(prefill_tokens: int, num_decodes: int) -> float:
    """Steps of tens of milliseconds: the event loop's own delays (a busy machine) stay small beside them."""
    return (30.0 + 3.0 * (num_decodes - 1) if num_decodes else 10.0) + 0.2 * prefill_tokens


class ByteText:
    """The fake engine's tokenizer as load sizes prompts with it: a token per byte."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode()


@pytest.fixture
def server(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    (tmp_path / "pipelines" / "chat.yaml").write_text(textwrap.dedent(CHAT))
    running = LiveServer(create_server(open_workspace(str(config)), engines=FakeEngines(smol=ModelledEngine(step_ms))))
    # As a real engine does once started (serving/engine/heap.py). This process holds the whole test
    # session's heap; one oldest-generation collection of it stalls the server's loop, and with it the
    # modelled engine's steps, for longer than the SLO's slack.
    freeze_startup_heap()
    try:
        yield running
    finally:
        thaw()
        running.stop()


async def test_plan_predicts_what_load_measures(server):
    clock = VirtualClock()
    profile = profile_engine(ModelledEngine(step_ms, clock=clock), lambda n, seed: [1 + (seed + i) % 200
                                                                                    for i in range(n)],
                             SamplingParams, clock=clock)
    model = StepModel(profile)
    shape = EngineShape(prompt_overhead_tokens=CHAT_OVERHEAD_TOKENS)
    figures = []
    for rate, duration in ((2.0, 12.0), (5.0, 12.0)):
        measured = await load_server(server.url, "chat", rate, duration, PROMPT, OUTPUT, seed=1, tokenizer=ByteText())
        assert measured["status"] == {"ok": measured["requests"]}
        predicted = plan_rate(requests_for(rate, duration, PROMPT, OUTPUT, seed=1), model, shape, SLO,
                              replicas=1)["tried"][0]["attainment"]
        figures.append((rate, predicted["all"]["attainment"], measured["slo"]["all"]["attainment"]))
    for _, predicted, measured in figures:
        assert abs(predicted - measured) <= 0.10, figures
    # The two rates are not alike: the second is where batching has begun to cost the ITL objective.
    assert figures[0][1] > figures[1][1] + 0.05, figures
