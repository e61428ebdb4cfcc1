"""The Ray Serve path against the single-process server's engine, and 2 engine replicas against 1.

    .venv/bin/python bench/ray.py [--quick] [--seed N]

Workload: bench/engine.py's mixed workload (64 requests, 16 with --quick; prompts 64-512 tokens,
max_tokens 16-256, 16-64 with --quick; greedy, EOS ignored), all submitted at once through the
pipelines' Engine protocol and streamed to the end, token by token: the way the generate and stream
stages use an engine. Three runs, one after the other, each warmed up first:

  single   the single-process server's engine (ModelPool, backend: local: our engine in a thread)
  ray1     backend: ray with 1 replica (a Ray Serve deployment on a local Ray, reached by handle), asking
           for both CPUs: Ray gives a replica's torch as many threads as its CPUs
  ray2     backend: ray with 2 replicas (1 CPU each of the 2; expect little gain on 2 cores)

``*_tok_s`` = output tokens / wall seconds. ``ray_vs_single_process`` = ray1 / single (target >= 0.85);
``two_vs_one_replica`` = ray2 / ray1. The last line is one JSON object. The machine is shared: read
the ratios, and compare across runs with care.
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
import time
import warnings
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "models/smollm2-135m-instruct"
MODEL = {"source": SOURCE, "device": "cpu", "dtype": "float32", "kv_cache": {"memory_gb": 0.5},
         "batching": {"max_num_seqs": 64, "max_num_batched_tokens": 512}}
#: The local Ray's CPUs, shared by the replicas: Ray gives a replica's torch as many threads as its CPUs.
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
    from serving.model_pool import ModelPool

    pool = ModelPool(server, ROOT)
    try:
        engine = await pool.get("smol")
        await burst(engine, requests[:2])  # warm-up
        return await burst(engine, requests)
    finally:
        await pool.close()


def ray_server(num_replicas: int) -> Any:
    from pipeline.spec import ModelSpec, ServerSpec

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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    os.chdir(ROOT)
    from pipeline.spec import ModelSpec, ServerSpec

    requests = mixed_requests(args.quick, args.seed)
    figures: dict[str, Any] = {"num_requests": len(requests), "quick": args.quick}
    log.info("single process ...")
    figures["single_tok_s"] = asyncio.run(run_pool(ServerSpec(models={"smol": ModelSpec.model_validate(MODEL)}),
                                                   requests))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import ray

        from serving.ray_backend import run_engines, serve
    ray.init(num_cpus=NUM_CPUS, include_dashboard=False, object_store_memory=200 << 20, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
        for replicas in (1, 2):
            log.info("ray, %d replica(s) ...", replicas)
            server = ray_server(replicas)
            run_engines(server, ROOT)
            figures[f"ray{replicas}_tok_s"] = asyncio.run(run_pool(server, requests))
            serve.delete("inferline")
    finally:
        serve.shutdown()
        ray.shutdown()
    figures["ray_vs_single_process"] = figures["ray1_tok_s"] / figures["single_tok_s"]
    figures["two_vs_one_replica"] = figures["ray2_tok_s"] / figures["ray1_tok_s"]
    for key, value in figures.items():
        print(f"  {key:28} {value:.4g}" if isinstance(value, float) else f"  {key:28} {value}")
    return figures


if __name__ == "__main__":
    result = main()
    print(json.dumps({k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in result.items()}), flush=True)
