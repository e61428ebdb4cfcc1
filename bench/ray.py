"""The Ray Serve path against the single-process server's engine, and 2 engine replicas against 1.

    .venv/bin/python bench/ray.py [--quick] [--seed N] [--repeat N]

Workload: bench/engine.py's mixed workload (64 requests, 16 with --quick; prompts 64-512 tokens,
max_tokens 16-256, 16-64 with --quick; greedy, EOS ignored), all submitted at once through the
pipelines' Engine protocol and streamed to the end, token by token: the way the generate and stream
stages use an engine. Each engine is warmed up first. Runs:

  single_before_ray  the single-process server's engine (ModelPool, backend: local: our engine in a thread in
                     this process), once, before Ray starts
  then --repeat rounds (default 2) of one burst each, in this order, while Ray is up (its processes idle
  during single); each figure is the median of its rounds (a round disturbed by another job on the machine
  moves a mean, not the median):
  single          the same single-process engine again
  ray1            backend: ray with 1 replica (a Ray Serve deployment on a local Ray, reached by handle), asking
                  for both CPUs (Ray gives a replica's torch as many threads as its CPUs). The replica streams
                  its events in lists, each holding every event ready when the previous list was sent
  ray1_per_token  the same replica streaming one event per item (as before the lists: every token crosses the
                  process boundary as its own Ray object)
  ray1_chunk4     the same replica holding events back until 4 are ready (the first and the last go at once):
                  a quarter of the items, tokens reaching the caller 4 at a time. Not what ships: it measures
                  what the per-item cost is
  (the three ray1 variants are separate applications side by side; only the one measured has work)
  ray2            backend: ray with 2 replicas (1 CPU each of the 2; expect little gain on 2 cores), after

``*_tok_s`` = output tokens / wall seconds. ``ray_vs_single_process`` = ray1 / single (target >= 0.85),
``ray_vs_single_before_ray`` = ray1 / single_before_ray; ``per_token_vs_single_process``,
``chunk4_vs_single_process`` likewise; ``batched_vs_per_token`` = ray1 / ray1_per_token;
``two_vs_one_replica`` = ray2 / ray1. ``*_events_per_item`` = token events per streamed item in that variant's
runs (1.0: nothing to batch). The last line is one JSON object. The machine is shared: read the ratios, and
compare across runs with care.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds http.py, which would shadow the standard library's http package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import random
import socket
import statistics
import time
import warnings
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "models/smollm2-135m-instruct"
MODEL = {"source": SOURCE, "device": "cpu", "dtype": "float32", "kv_cache": {"memory_gb": 0.5},
         "batching": {"max_num_seqs": 64, "max_num_batched_tokens": 512}}
#: The machine's CPUs, shared by the replicas: Ray gives a replica's torch as many threads as its CPUs.
NUM_CPUS = 2
log = logging.getLogger("bench.ray")


def _bench_engine():
    spec = importlib.util.spec_from_file_location("_bench_engine", ROOT / "bench" / "engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["_bench_engine"] = module
    spec.loader.exec_module(module)
    return module


def mixed_requests(quick: bool, seed: int) -> list[tuple[list[int], int]]:
    from transformers import AutoTokenizer

    w = _bench_engine()
    pool = w.text_pool(AutoTokenizer.from_pretrained(ROOT / SOURCE), 4096)
    return [(r.prompt_ids, r.max_tokens) for r in w.mixed_requests(pool, w.QUICK if quick else w.FULL,
                                                                     random.Random(seed))]


async def burst(engine: Any, requests: list[tuple[list[int], int]]) -> float:
    """All requests at once, each streamed to its end; output tokens per wall second."""
    from pipeline.protocols import SamplingParams

    async def one(prompt: list[int], max_tokens: int) -> int:
        stream = await engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        count = 0
        async for event in stream:
            count += event.token_id is not None
        if count != max_tokens:
            raise RuntimeError(f"a request produced {count} tokens, {max_tokens} asked")
        return count

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(p, m) for p, m in requests))
    return sum(tokens) / (time.perf_counter() - start)


async def run_pool(server: Any, requests: list[tuple[list[int], int]]) -> float:
    from serving.backends.model_pool import ModelPool

    pool = ModelPool(server, ROOT)
    try:
        engine = await pool.get("smol")
        await burst(engine, requests[:2])  # warm-up
        return await burst(engine, requests)
    finally:
        await pool.close()


class ItemCount:
    """Counts the items RayEngine reads and the events they hold (by wrapping serving.backends.ray_engine._as_list)."""

    def __init__(self) -> None:
        import serving.backends.ray_engine as backend

        self.items = self.events = 0
        unwrap = backend._as_list

        def counted(item: Any) -> list[dict[str, Any]]:
            events = unwrap(item)
            self.items += 1
            self.events += len(events)
            return events

        backend._as_list = counted

    def reset(self) -> None:
        self.items = self.events = 0


def per_token_deployment() -> Any:
    """EngineDeployment streaming one event per item: the replica before the batching."""
    from serving.backends.ray_replica import EngineDeployment
    from serving.backends.ray_serve import serve

    base = EngineDeployment.func_or_class

    class PerTokenEngine(base):
        async def generate(self, *args: Any, **kwargs: Any):
            async for events in base.generate(self, *args, **kwargs):
                for event in events:
                    yield event

    return serve.deployment(name="engine")(PerTokenEngine)


def chunked_deployment(size: int) -> Any:
    """EngineDeployment holding events back until *size* are ready (the first, and the last, go at once):
    fewer items, at the price of tokens reaching the caller in bursts of *size*."""
    from serving.backends.ray_replica import EngineDeployment
    from serving.backends.ray_serve import serve

    base = EngineDeployment.func_or_class

    class ChunkedEngine(base):
        async def generate(self, *args: Any, **kwargs: Any):
            held: list[dict[str, Any]] = []
            sent_first = False
            async for events in base.generate(self, *args, **kwargs):
                held += events
                if not sent_first or len(held) >= size or held[-1].get("finish_reason") or "error" in held[-1]:
                    sent_first = True
                    yield held
                    held = []
            if held:
                yield held

    return serve.deployment(name="engine")(ChunkedEngine)


#: The 1-replica variants of the ray1 phase: result name -> (Ray Serve application, deployment class or None
#: for ours as it ships).
VARIANTS = {"ray1": ("inferline", None), "ray1_per_token": ("bench-per-token", per_token_deployment),
            "ray1_chunk4": ("bench-chunk4", lambda: chunked_deployment(4))}


def deploy_variants(server: Any) -> None:
    """Each variant's application, side by side (each replica asks for all the CPUs; one runs at a time)."""
    import serving.backends.ray_replica as backend

    backend.run_engines(server, ROOT)
    shipped = backend.EngineDeployment
    for app, make in VARIANTS.values():
        if make is None:
            continue
        backend.EngineDeployment = make()
        try:
            backend.serve.run(backend.EngineSet.bind(**backend.bind_engines(server, ROOT)), name=app,
                              route_prefix=None)
        finally:
            backend.EngineDeployment = shipped


async def rounds(local: Any, ray: Any, requests: list[tuple[list[int], int]], repeat: int,
                 counter: ItemCount) -> dict[str, float]:
    """*repeat* rounds of single, then each ray1 variant, one burst each: medians, and events per item."""
    from serving.backends.model_pool import ModelPool
    from serving.backends.ray_deploy import deployment_name
    from serving.backends.ray_engine import RayEngine
    from serving.backends.ray_serve import serve

    local_pool, ray_pool = ModelPool(local, ROOT), ModelPool(ray, ROOT)
    try:
        shipped = await ray_pool.get("smol")
        engines = {"single": await local_pool.get("smol")}
        for name, (app, _) in VARIANTS.items():
            engines[name] = shipped if app == "inferline" else RayEngine(
                "smol", serve.get_deployment_handle(deployment_name("smol"), app_name=app), shipped.tokenizer,
                shipped.weights_hash)
        for engine in engines.values():
            await burst(engine, requests[:2])  # warm-up
        runs: dict[str, list[float]] = {name: [] for name in engines}
        counts = {name: [0, 0] for name in VARIANTS}
        for _ in range(repeat):
            for name, engine in engines.items():
                counter.reset()
                runs[name].append(await burst(engine, requests))
                if name in counts:
                    counts[name][0] += counter.items
                    counts[name][1] += counter.events
        log.info("runs (tok/s): %s", {name: [round(v, 1) for v in values] for name, values in runs.items()})
        figures = {f"{name}_tok_s": statistics.median(values) for name, values in runs.items()}
        figures |= {f"{name}_events_per_item": events / items for name, (items, events) in counts.items()}
        return figures
    finally:
        await local_pool.close()
        await ray_pool.close()


def ray_server(num_replicas: int) -> Any:
    from serving.config.models import ModelSpec
    from serving.config.server import ServerSpec

    return ServerSpec(models={"smol": ModelSpec.model_validate(
        {**MODEL, "backend": "ray",
         "ray": {"num_replicas": num_replicas, "ray_actor_options": {"num_cpus": NUM_CPUS // num_replicas}}})})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 requests with short outputs instead of 64")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of single and the ray1 variants (default 2)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    os.chdir(ROOT)
    from serving.config.models import ModelSpec
    from serving.config.server import ServerSpec

    requests = mixed_requests(args.quick, args.seed)
    local = ServerSpec(models={"smol": ModelSpec.model_validate(MODEL)})
    figures: dict[str, Any] = {"num_requests": len(requests), "quick": args.quick, "repeat": args.repeat}
    log.info("single process, before Ray starts ...")
    figures["single_before_ray_tok_s"] = asyncio.run(run_pool(local, requests))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import ray

        from serving.backends.ray_replica import run_engines
        from serving.backends.ray_serve import serve
    counter = ItemCount()
    # Logical CPUs: the 1-replica variants wait side by side, each asking for all of the machine's.
    ray.init(num_cpus=len(VARIANTS) * NUM_CPUS, include_dashboard=False, object_store_memory=200 << 20,
             logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
        log.info("rounds: single process, then ray, 1 replica: %s ...", ", ".join(VARIANTS))
        deploy_variants(ray_server(1))
        figures.update(asyncio.run(rounds(local, ray_server(1), requests, args.repeat, counter)))
        for app, _ in VARIANTS.values():
            serve.delete(app)
        log.info("ray, 2 replicas ...")
        server = ray_server(2)
        run_engines(server, ROOT)
        figures["ray2_tok_s"] = asyncio.run(run_pool(server, requests))
        serve.delete("inferline")
    finally:
        serve.shutdown()
        ray.shutdown()
    single = figures["single_tok_s"]
    figures["ray_vs_single_process"] = figures["ray1_tok_s"] / single
    figures["ray_vs_single_before_ray"] = figures["ray1_tok_s"] / figures["single_before_ray_tok_s"]
    figures["per_token_vs_single_process"] = figures["ray1_per_token_tok_s"] / single
    figures["chunk4_vs_single_process"] = figures["ray1_chunk4_tok_s"] / single
    figures["batched_vs_per_token"] = figures["ray1_tok_s"] / figures["ray1_per_token_tok_s"]
    figures["two_vs_one_replica"] = figures["ray2_tok_s"] / figures["ray1_tok_s"]
    for key, value in figures.items():
        print(f"  {key:32} {value:.4g}" if isinstance(value, float) else f"  {key:32} {value}")
    return figures


if __name__ == "__main__":
    result = main()
    print(json.dumps({k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in result.items()}), flush=True)
