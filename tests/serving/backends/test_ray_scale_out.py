"""Scale-out of a ray model on a local Ray started here (2 CPUs): autoscaling from 1 replica to 2 under
load and back, and prefix-aware placement through our request router (requests that share a prompt
prefix land on one replica, which then hits its prefix cache)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from pipeline.protocols import SamplingParams
from serving.backends.model_pool import ModelPool
from serving.config.models import ModelSpec
from serving.config.server import ServerSpec

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).parents[3]
SMALL = {"source": "models/smollm2-135m-instruct", "device": "cpu", "dtype": "float32",
         "kv_cache": {"memory_gb": 0.25}, "backend": "ray"}
#: Half a CPU each: two replicas fit on the local Ray's 2 CPUs beside Serve's own actors.
HALF_CPU = {"ray_actor_options": {"num_cpus": 0.5}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    from serving.backends.ray_serve import serve

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
        yield serve
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def deployed(local_ray, monkeypatch):
    """Deploys a ServerSpec's engines (``deployed(server)``); deletes the application afterwards."""
    from serving.backends.ray_deploy import APP_NAME
    from serving.backends.ray_replica import run_engines

    monkeypatch.chdir(ROOT)
    yield lambda server: run_engines(server, ROOT)
    local_ray.delete(APP_NAME)


def replica_states(deployment: str) -> dict[str, int]:
    """Replica counts by state (RUNNING, STARTING, STOPPING...) as the Serve controller reports them."""
    from serving.backends.ray_deploy import APP_NAME
    from serving.backends.ray_serve import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None or deployment not in app.deployments:
        return {}
    return {str(state): count for state, count in app.deployments[deployment].replica_states.items()}


async def wait_for_states(deployment: str, expected: dict[str, int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (states := replica_states(deployment)) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"{deployment}: replicas {states} after {timeout_s:.0f} s, expected {expected}")
        await asyncio.sleep(0.5)


def replica_ids(deployment: str) -> list[str]:
    import ray

    from serving.backends.ray_deploy import APP_NAME

    prefix = f"SERVE_REPLICA::{APP_NAME}#{deployment}#"
    return sorted(actor["name"].removeprefix(prefix) for actor in ray.util.list_named_actors(all_namespaces=True)
                  if actor["namespace"] == "serve" and actor["name"].startswith(prefix))


async def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(deployed):
    from serving.backends.ray_deploy import deployment_name

    server = ServerSpec(models={"smol": ModelSpec.model_validate({**SMALL, "ray": {**HALF_CPU, "autoscaling": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0,
        "downscale_delay_s": 2, "look_back_period_s": 2, "metrics_interval_s": 0.5}}})})
    deployed(server)
    name = deployment_name("smol")
    assert replica_states(name) == {"RUNNING": 1}
    pool = ModelPool(server, ROOT)
    streams = []
    try:
        engine = await pool.get("smol")
        long = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
        for text in ("Count to a thousand.", "List every country.", "Tell a very long story."):
            ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
            streams.append(await asyncio.wait_for(engine.submit(ids, long), timeout=60))
        # Three requests in flight against a target of one per replica: Ray Serve asks for two (its maximum).
        await wait_for_states(name, {"RUNNING": 2}, timeout_s=120)
        for stream in streams:
            await stream.aclose()
        streams.clear()
        assert engine.outstanding == 0
        # Idle past downscale_delay_s: back to min_replicas.
        await wait_for_states(name, {"RUNNING": 1}, timeout_s=90)
        # The one left still answers.
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Hello"}])
        again = await asyncio.wait_for(engine.submit(ids, SamplingParams(max_tokens=4, temperature=0)), timeout=60)
        assert [e async for e in again][-1].finish_reason == "length"
    finally:
        for stream in streams:
            await stream.aclose()
        await pool.close()


#: A system prompt far longer than the router's 4 blocks of 16 tokens, so requests that share it share
#: their prefix key; each variant starts differently so that the variants' keys differ.
SHARED = ("You are the support assistant of Example Corp. Answer from the handbook, politely and briefly. "
          "Never reveal internal ticket numbers, never promise refunds, and escalate legal questions to a person. "
          "Quote the handbook section you used. If you do not know, say so and offer to open a ticket.")


def _system(variant: int) -> str:
    return f"Variant {variant}. {SHARED}"


async def test_requests_sharing_a_prefix_land_on_one_replica_and_hit_its_cache(deployed):
    from serving.backends.placement import Placement
    from serving.backends.ray_deploy import PREFIX_BLOCKS, deployment_name
    from serving.backends.ray_router import rank

    server = ServerSpec(models={"smol": ModelSpec.model_validate(
        {**SMALL, "placement": "prefix", "ray": {**HALF_CPU, "num_replicas": 2}})})
    deployed(server)
    ids_of_replicas = replica_ids(deployment_name("smol"))
    assert len(ids_of_replicas) == 2
    placement = Placement(1, "prefix", 16, PREFIX_BLOCKS)
    pool = ModelPool(server, ROOT)
    try:
        engine = await pool.get("smol")

        def prompt(variant: int, question: str) -> list[int]:
            return engine.tokenizer.encode_chat([{"role": "system", "content": _system(variant)},
                                                 {"role": "user", "content": question}])

        # Two prefixes that rendezvous hashing sends to each replica: both replicas get work.
        by_replica: dict[str, list[int]] = {replica: [] for replica in ids_of_replicas}
        variant = 0
        while min(len(v) for v in by_replica.values()) < 2:
            home = rank(placement.prefix_key(prompt(variant, "Hi")), ids_of_replicas)[0]
            if len(by_replica[home]) < 2:
                by_replica[home].append(variant)
            variant += 1
        served: dict[int, list[tuple[str, int]]] = {}
        for home, variants in by_replica.items():
            for v in variants:
                for question in ("How do I reset my password?", "Where is my order?", "Can I get a refund?"):
                    stream = await asyncio.wait_for(
                        engine.submit(prompt(v, question), SamplingParams(max_tokens=2, temperature=0)), timeout=60)
                    events = [e async for e in stream]
                    served.setdefault(v, []).append((stream.replica, events[-1].num_cached_tokens))
                assert {replica for replica, _ in served[v]} == {home}, served[v]
        # After the first request of a prefix, its replica holds the prefix's blocks: the others hit them.
        for v, answers in served.items():
            assert all(cached >= PREFIX_BLOCKS * 16 for _, cached in answers[1:]), (v, answers)
        assert engine.outstanding == 0
    finally:
        await pool.close()
