"""``telemetry: {vllm_metric_names: true}``: /metrics also carries the engine's series under vLLM's names,
the ones the Gateway API Inference Extension's endpoint picker and KEDA read."""

from __future__ import annotations

from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from serving.engine.metrics import EngineMetrics
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import write_workspace


def scrape(tmp_path, monkeypatch, on: bool) -> dict[str, dict[tuple, float]]:
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    if on:
        config.write_text(config.read_text() + "telemetry: {vllm_metric_names: true}\n")
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine()))
    with TestClient(app) as client:
        engine = EngineMetrics("smol", app.state.inferline.registry)  # what a local engine registers
        engine.set_gauges(running=2, waiting=3, kv_usage=0.25)
        engine.add_tokens(prompt=120, generated=40)
        engine.add_prefix(queries=100, hits=60)
        engine.observe_finished(0.8)
        text = client.get("/metrics").text
    return {family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == family.name
                          or s.name == family.name + "_total" or s.name.endswith("_count")}
            for family in text_string_to_metric_families(text)}


def test_vllm_names_on_request(tmp_path, monkeypatch):
    families = scrape(tmp_path, monkeypatch, on=True)
    smol = (("model_name", "smol"),)
    assert families["vllm:num_requests_waiting"][smol] == 3 and families["vllm:num_requests_running"][smol] == 2
    assert families["vllm:kv_cache_usage_perc"][smol] == 0.25 == families["vllm:gpu_cache_usage_perc"][smol]
    assert families["vllm:prompt_tokens"][smol] == 120 and families["vllm:generation_tokens"][smol] == 40
    assert families["vllm:prefix_cache_queries"][smol] == 100 and families["vllm:prefix_cache_hits"][smol] == 60
    assert families["vllm:e2e_request_latency_seconds"][smol] == 1  # the histogram's count
    assert families["inferline_num_requests_waiting"][smol] == 3  # our own names stay
    assert "vllm:decode_step_seconds" not in families  # ours only: not under vLLM's prefix


def test_off_by_default(tmp_path, monkeypatch):
    assert not any(name.startswith("vllm:") for name in scrape(tmp_path, monkeypatch, on=False))
