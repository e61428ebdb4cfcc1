"""backend: ray on a local Ray started by the test: the same greedy tokens as the local engine."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pipeline.protocols import SamplingParams
from serving.backends.model_pool import ModelPool
from serving.config.models import ModelSpec
from serving.config.server import ServerSpec

ROOT = Path(__file__).parents[3]
SOURCE = "models/smollm2-135m-instruct"
SMALL = {"source": SOURCE, "device": "cpu", "dtype": "float32", "kv_cache": {"memory_gb": 0.25}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    from serving.backends.ray_serve import serve

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
        yield serve
    finally:
        serve.shutdown()
        ray.shutdown()


async def _greedy(engine, messages) -> list[int]:
    ids = engine.tokenizer.encode_chat(messages)
    stream = await engine.submit(ids, SamplingParams(max_tokens=16, temperature=0))
    events = [event async for event in stream]
    assert events[-1].finish_reason is not None
    assert events[-1].num_prompt_tokens == len(ids)
    assert events[-1].num_output_tokens == len([e for e in events if e.token_id is not None])
    return [event.token_id for event in events if event.token_id is not None]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_a_ray_model_streams_what_the_local_engine_does(local_ray, monkeypatch):
    from serving.backends.ray_engine import RayEngine
    from serving.backends.ray_replica import run_engines

    monkeypatch.chdir(ROOT)
    messages = [{"role": "user", "content": "Name three colours."}]
    ray_server = ServerSpec(models={"smol": ModelSpec.model_validate(
        {**SMALL, "backend": "ray", "ray": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}})})
    assert run_engines(ray_server, ROOT) == ["smol"]
    ray_pool = ModelPool(ray_server, ROOT)
    local_pool = ModelPool(ServerSpec(models={"smol": ModelSpec.model_validate(SMALL)}), ROOT)
    try:
        remote = await ray_pool.get("smol")
        assert isinstance(remote, RayEngine)
        local = await local_pool.get("smol")
        assert remote.weights_hash == local.weights_hash
        assert await _greedy(remote, messages) == await _greedy(local, messages)
        assert remote.outstanding == 0
    finally:
        await ray_pool.close()
        await local_pool.close()
