"""Structured output on our engine: what a constraint costs a decode, and what a compiled one costs again.

    .venv/bin/python bench/structured.py [--quick] [--model DIR] [--rounds N]

SmolLM2-135M-Instruct in float32 on the CPU with 2 torch threads, greedy, one ``LLMEngine`` for both sides.

Mixed workload: 8 requests (4 with --quick) at once, each a different chat question asking for a JSON answer;
every round runs the same prompts twice, one after the other: ``constrained``, where the requests take turns
among the three kinds of ``output``, and ``free`` (no constraint, ``ignore_eos``, ``max_tokens`` the length of the
constrained answer to the same prompt, so both sides decode batches of the same sizes). The constraints: a
JSON Schema (an object with a string, an integer, an enum and an array of strings), a regular expression
(an ISO date then a comment) and a choice of four strings. Only decode counts: each side's figure is output
tokens after the first / the seconds of the engine's decode steps (``decode_step_seconds`` of its metrics
snapshot), so the prompt's prefill, the same on both sides, does not dilute the ratio. Rounds alternate the
order (free first, then constrained first) and the best round of each side counts (noise on a shared
machine only ever slows a run down).

  constrained_vs_free  constrained decode tok/s / free decode tok/s (target >= 0.8)
  compile_cold_ms      a schema's first compilation (the vocabulary table built beforehand, not counted)
  compile_cached_ms    the same schema again: the median of 200 lookups (target < 1 ms)

The last line is one JSON object with these keys and the raw figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds http.py, which would shadow the standard library's http package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.sampling_params import SamplingParams

MODEL_DIR = "models/smollm2-135m-instruct"
MAX_TOKENS = 96
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population", "size", "sights"],
          "properties": {"city": {"type": "string", "maxLength": 40},
                         "population": {"type": "integer", "minimum": 0},
                         "size": {"enum": ["small", "medium", "large"]},
                         "sights": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}}}
OUTPUTS = ({"json_schema": SCHEMA},
           {"regex": r"\d{4}-\d{2}-\d{2}: [a-z ,]{10,200}\."},
           {"choice": ["north of the river", "south of the river", "on the coast", "in the mountains"]})
CITIES = ("Paris", "Lyon", "Berlin", "Madrid", "Rome", "Vienna", "Oslo", "Lisbon")


def _prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    tokenizer = engine.tokenizer
    texts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe {city} as JSON: its name, population, size and three sights."}],
        add_generation_prompt=True, tokenize=False) for city in CITIES[:count]]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def _decode_tok_s(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    """Output tokens after each request's first / seconds of decode steps, and the output tokens."""
    before = engine.metrics.snapshot()["decode_step_seconds"]["sum"]
    outputs = engine.generate(prompts, params)
    seconds = engine.metrics.snapshot()["decode_step_seconds"]["sum"] - before
    tokens = sum(len(o.token_ids) for o in outputs)
    return (tokens - len(outputs)) / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 requests a side, 2 rounds")
    parser.add_argument("--model", default=MODEL_DIR)
    parser.add_argument("--rounds", type=int, default=None, help="rounds per side (default 4, 2 with --quick)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    count, rounds = (4, 2) if args.quick else (8, 4)
    rounds = args.rounds or rounds
    engine = LLMEngine(EngineConfig(model=args.model, device="cpu", dtype="float32"))
    prompts = _prompts(engine, count)
    constrained = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, speculative=False,
                                  output=OUTPUTS[i % len(OUTPUTS)]) for i in range(count)]

    started = time.perf_counter()
    engine.compile_output({"regex": "warm"})  # builds the vocabulary table: once per engine, not per schema
    table_s = time.perf_counter() - started
    started = time.perf_counter()
    engine.compile_output({"json_schema": SCHEMA})
    compile_cold_ms = (time.perf_counter() - started) * 1e3
    cached = []
    for _ in range(200):
        started = time.perf_counter()
        engine.compile_output({"json_schema": SCHEMA})
        cached.append((time.perf_counter() - started) * 1e3)

    # Warm-up (kernels, allocator), and each constrained request's length: the free request on the same
    # prompt then generates exactly as many tokens, so both sides decode batches of the same sizes.
    lengths = [len(o.token_ids) for o in engine.generate(prompts, constrained)]
    free = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, speculative=False) for n in lengths]
    sides: dict[str, list[float]] = {"free": [], "constrained": []}
    tokens: dict[str, int] = {}
    for round_ in range(rounds):
        order = ("free", "constrained") if round_ % 2 == 0 else ("constrained", "free")
        for side in order:
            tok_s, tokens[side] = _decode_tok_s(engine, prompts, free if side == "free" else constrained)
            sides[side].append(tok_s)
            print(f"round {round_ + 1} {side:12s} {tok_s:7.1f} decode tok/s ({tokens[side]} tokens)", flush=True)
    free_tok_s, constrained_tok_s = max(sides["free"]), max(sides["constrained"])
    report = {
        "constrained_vs_free": round(constrained_tok_s / free_tok_s, 3),
        "compile_cached_ms": round(statistics.median(cached), 4),
        "compile_cold_ms": round(compile_cold_ms, 2),
        "vocabulary_table_s": round(table_s, 3),
        "free_decode_tok_s": round(free_tok_s, 1), "constrained_decode_tok_s": round(constrained_tok_s, 1),
        "free_decode_tok_s_rounds": [round(v, 1) for v in sides["free"]],
        "constrained_decode_tok_s_rounds": [round(v, 1) for v in sides["constrained"]],
        "num_requests": count, "output_tokens": tokens,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
