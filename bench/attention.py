"""Paged attention: our C++ kernel against the torch path (gather + SDPA), per layer, in one run.

    .venv/bin/python bench/attention.py [--repeats N]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, 16-token blocks), float32, 2 threads,
one layer's KV cache with each sequence's blocks scattered over the pool. Each case builds the step's metadata
once (as the model runner does, outside the timing) and times ``paged_attention`` for one layer, best of N
(default 30), the two paths alternating call by call:
  decode_mixed64     64 decodes, contexts uniformly 64-768 (the mixed workload's steady state)
  decode_uniform32   32 decodes at 192 tokens of context (the uniform workload)
  decode_1           one decode at 160 tokens (batch-1 decode)
  tail37_after1024   a 37-token prompt tail after a 1,024-token prefix-cache hit (prefix reuse TTFT)
  spec5_x4           4 sequences verifying 4 guesses each (5 tokens) after 300 tokens
  chunk64/128/256_after512  one chunk of N tokens after 512 of context (a long prompt's later chunks)
  prompt64/512       a fresh prompt of N tokens, no context (its torch side: causal SDPA on the fresh K/V)
The engine sends every case to the kernel when it is built (model_runner._kernel_metadata).
The last line is one JSON object: for each case ``{case}_torch_us``, ``{case}_kernel_us`` and
``{case}_speedup`` (torch / kernel), plus ``max_abs_diff`` over every case.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import os
import random
import time
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from serving.engine import model_runner as mr
from serving.engine.attention import paged_attention, write_kv
from serving.engine.kernels import cpu_ops, disabled_reason
from serving.engine.model_runner import ModelRunner
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import ScheduledSeq
from serving.engine.sequence import Sequence

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 9, 3, 64, 16, 4096


def cases(rng: random.Random) -> dict[str, list[tuple[int, int]]]:
    """(context, new tokens) per sequence."""
    return {
        "decode_mixed64": [(rng.randint(64, 768), 1) for _ in range(64)],
        "decode_uniform32": [(192, 1)] * 32,
        "decode_1": [(160, 1)],
        "tail37_after1024": [(1024, 37)],
        "spec5_x4": [(300, 5)] * 4,
        "chunk64_after512": [(512, 64)],
        "chunk128_after512": [(512, 128)],
        "chunk256_after512": [(512, 256)],
        "prompt64": [(0, 64)],
        "prompt512": [(0, 512)],
    }


def step(runner: ModelRunner, rng: random.Random, work: list[tuple[int, int]]):
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    items = []
    for seq_id, (num_context, num_new) in enumerate(work):
        total = num_context + num_new
        seq = Sequence(seq_id, [0] * total, total, SamplingParams())
        seq.block_table = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        seq.num_computed_tokens = num_context
        items.append(ScheduledSeq(seq, num_new))
    items = runner.order(items)
    slots = [s for it in items for s in mr._slots(it.seq.block_table, it.seq.num_computed_tokens,
                                                   it.seq.num_computed_tokens + it.num_new_tokens, BLOCK_SIZE)]
    return items, torch.tensor(slots)


def best_us(calls: dict[bool, Callable[[], object]], repeats: int) -> dict[bool, float]:
    """Best time of each call, alternating between them so that both see the same machine."""
    best = dict.fromkeys(calls, float("inf"))
    for fn in calls.values():
        fn()
    for _ in range(repeats):
        for key, fn in calls.items():
            start = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - start)
    return {key: value * 1e6 for key, value in best.items()}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per case and path (best kept)")
    args = parser.parse_args(argv)
    if cpu_ops() is None:
        raise SystemExit(f"the C++ kernels are unavailable: {disabled_reason()}")
    torch.set_num_threads(2)
    torch.manual_seed(0)
    rng = random.Random(0)
    shape = SimpleNamespace(num_layers=1, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    runner = ModelRunner(SimpleNamespace(shape=shape, dtype=torch.float32, kv_dtype=torch.float32,
                                         device=torch.device("cpu")),
                         NUM_BLOCKS, BLOCK_SIZE)
    runner.k_caches[0].normal_()
    runner.v_caches[0].normal_()
    k_cache, v_cache = runner.k_caches[0], runner.v_caches[0]
    result: dict[str, float] = {}
    max_diff = 0.0
    for name, work in cases(rng).items():
        items, slots = step(runner, rng, work)
        num_tokens = len(slots)
        q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM)
        k, v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM), torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        metas = {}
        for use_kernel in (False, True):
            runner.use_kernel = use_kernel
            metas[use_kernel] = runner._metadata(items, slots)
        write_kv(k_cache, v_cache, k, v, slots)  # as each layer does before attention
        outs = {u: paged_attention(q, k, v, k_cache, v_cache, m) for u, m in metas.items()}
        max_diff = max(max_diff, (outs[True] - outs[False]).abs().max().item())
        calls = {u: partial(paged_attention, q, k, v, k_cache, v_cache, m) for u, m in metas.items()}
        times = best_us(calls, args.repeats)
        torch_us, kernel_us = times[False], times[True]
        result[f"{name}_torch_us"] = round(torch_us, 1)
        result[f"{name}_kernel_us"] = round(kernel_us, 1)
        result[f"{name}_speedup"] = round(torch_us / kernel_us, 2)
        print(f"{name:20s} torch {torch_us:9.1f} us   kernel {kernel_us:9.1f} us   x{torch_us / kernel_us:.2f}",
              flush=True)
    result["max_abs_diff"] = max_diff
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
