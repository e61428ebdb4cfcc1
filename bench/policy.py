"""Policy rails: what the input rails add to a 2,000-token prompt, and what the output rails cost a stream.

    .venv/bin/python bench/policy.py [--quick] [--iterations N] [--clients C] [--max-tokens T] [--rounds R]
                                     [--config FILE]

input   Two pipelines that stop before the model (so that only the rails differ): ``prompt`` alone, and
        ``policy`` (PII redact over every type, three deny rules, injection heuristics; no limits, no token
        counting) then ``prompt``. The request is ~2,000 tokens of English prose (counted with the default
        model's tokenizer) with a few email addresses, phone numbers and card numbers in it. Both run
        N (300) times through the real runner, interleaved; ``input_rails_ms_p50`` is the median of with
        minus the median of without (target <= 2 ms). ``input_rails_stage_ms_p50`` is the policy stage's
        own duration from its stage record.
output  The default model on the real engine (as ``inferline serve`` builds it), chat pipeline
        ``prompt → tokenize → generate → stream`` with and without a policy stage whose output rails run PII
        redaction and the deny rules over the stream. C (8) concurrent requests of T (128) greedy tokens with
        ``ignore_eos``, R (3) rounds per side, interleaved; the best round of each is kept (noisy machine).
        ``output_rails_throughput_ratio`` = with tok/s / without tok/s (target >= 0.95).
        ``output_rails_us_per_token`` is the rails' own cost per streamed token, measured by feeding the
        answers' text through the rails alone.

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import asyncio
import json
import os
import statistics
import textwrap
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pipeline.context import RequestContext
from pipeline.events import Done, TextDelta
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Resources
from pipeline.runner import Pipeline, Runner
from serving.config.loader import catalog_of
from serving.runtime.workspace import open_workspace

POLICY = """
  - id: guard
    type: policy
    with:
      pii: redact
      deny:
        - credentials
        - malware
        - {id: weapons, category: safety, regex: ['\\b(?:build|make)\\s{1,3}(?:a|an)\\s{1,3}(?:bomb|explosive)\\b']}
      injection: {action: block, threshold: 0.5}
      output: {pii: redact, deny: true}
"""

PARAGRAPH = (
    "Our quarterly review covered the migration of the billing service, the new onboarding flow and the "
    "support backlog. Customers asked about invoices, refunds and the timeline for the regional data centre. "
    "The team agreed to publish release notes for version 2.13.0 on 2024-01-15 and to follow up by mail. "
)
PII = ["Contact jane.doe@example.com or call (415) 555-2671.", "Card on file: 4111 1111 1111 1111.",
       "Escalations go to ops-team@corp.example, +44 20 7946 0958."]


def long_prompt(tokenizer, target: int = 2000) -> str:
    parts, i = [], 0
    while len(tokenizer.encode("".join(parts))) < target:
        parts.append(PARAGRAPH + (PII[i % len(PII)] + " " if i % 3 == 0 else ""))
        i += 1
    return "".join(parts)


def pipeline(yaml_text: str, workspace, resources: Resources) -> Pipeline:
    loaded = load_pipeline_text(textwrap.dedent(yaml_text), "bench.yaml", workspace.registry,
                                catalog_of(workspace.server))
    return Pipeline(loaded, resources)


async def bench_input(workspace, text: str, iterations: int) -> dict[str, float]:
    resources = Resources(catalog_of(workspace.server))  # no engine: only the stages before the model run
    plain = pipeline("name: plain\nstages:\n  - {id: prompt, type: prompt}\n", workspace, resources)
    guarded = pipeline("name: guarded\nstages:\n" + POLICY + "  - {id: prompt, type: prompt}\n",
                       workspace, resources)
    runner = Runner()
    times: dict[str, list[float]] = {"plain": [], "guarded": []}
    stage_ms: list[float] = []
    for i in range(iterations + 20):
        for name, pipe in (("plain", plain), ("guarded", guarded)):
            ctx = RequestContext.from_text(name, text)
            started = time.perf_counter()
            final = await runner.run(pipe, ctx)
            elapsed = time.perf_counter() - started
            if not isinstance(final, Done):
                raise SystemExit(f"{name} did not finish: {final}")
            if i >= 20:  # warm-up
                times[name].append(elapsed * 1e3)
                if name == "guarded":
                    stage_ms.append(final.summary.stages[0].duration_s * 1e3)
    plain_ms, guarded_ms = statistics.median(times["plain"]), statistics.median(times["guarded"])
    return {"input_rails_ms_p50": round(guarded_ms - plain_ms, 3),
            "input_rails_stage_ms_p50": round(statistics.median(stage_ms), 3),
            "input_plain_ms_p50": round(plain_ms, 3), "input_guarded_ms_p50": round(guarded_ms, 3)}


CHAT = """
  - {{id: prompt, type: prompt}}
  - {{id: tok, type: tokenize}}
  - {{id: gen, type: generate, with: {{max_tokens: {max_tokens}, temperature: 0, ignore_eos: true}}}}
  - {{id: out, type: stream}}
"""

QUESTIONS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
             "Describe a walk through a forest in autumn.", "List some tips for writing clear emails.",
             "Tell me about the history of tea.", "What makes a good team meeting?",
             "Describe the water cycle for a child.", "Write a letter to a new neighbour."]


async def one_round(runner: Runner, pipe: Pipeline, clients: int) -> tuple[float, list[str]]:
    async def ask(question: str) -> tuple[int, str]:
        ctx = RequestContext.from_text(pipe.name, question)
        parts = [e.text async for e in runner.stream(pipe, ctx) if isinstance(e, TextDelta)]
        return ctx.usage.output_tokens, "".join(parts)

    started = time.perf_counter()
    results = await asyncio.gather(*(ask(QUESTIONS[i % len(QUESTIONS)]) for i in range(clients)))
    elapsed = time.perf_counter() - started
    return sum(n for n, _ in results) / elapsed, [t for _, t in results]


async def bench_output(workspace, clients: int, max_tokens: int, rounds: int) -> dict[str, float]:
    from serving.backends.model_pool import ModelPool

    pool = ModelPool(workspace.server, workspace.root)
    resources = Resources(catalog_of(workspace.server), engines=pool)
    chat = CHAT.format(max_tokens=max_tokens)
    plain = pipeline("name: plain\nstages:\n" + chat, workspace, resources)
    guarded = pipeline("name: guarded\nstages:\n" + POLICY + chat, workspace, resources)
    runner = Runner()
    try:
        await pool.start_all()
        await one_round(runner, plain, clients)  # warm-up: kernels and the prefix cache, for both sides
        best = {"plain": 0.0, "guarded": 0.0}
        texts: list[str] = []
        for _ in range(rounds):
            for name, pipe in (("plain", plain), ("guarded", guarded)):
                tok_s, answers = await one_round(runner, pipe, clients)
                best[name] = max(best[name], tok_s)
                texts = answers if name == "plain" else texts
    finally:
        await pool.close()
    return {"output_rails_throughput_ratio": round(best["guarded"] / best["plain"], 4),
            "output_tok_s_plain": round(best["plain"], 1), "output_tok_s_guarded": round(best["guarded"], 1),
            "output_rails_us_per_token": rails_cost(guarded, texts, clients * max_tokens)}


def rails_cost(guarded: Pipeline, texts: list[str], num_tokens: int) -> float:
    """The rails alone over the answers' text, fed in ~4-character pieces (one token's worth)."""
    policy = guarded.stages[0].stage
    started = time.perf_counter()
    for text in texts:
        rails = policy.output_rails()
        for start in range(0, len(text), 4):
            rails.feed(text[start:start + 4])
        rails.flush()
    return round((time.perf_counter() - started) / max(1, num_tokens) * 1e6, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations and tokens (a smoke run)")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", default=None, help="inferline.yaml (default: ./inferline.yaml)")
    args = parser.parse_args(argv)
    if args.quick:
        args.iterations, args.max_tokens, args.rounds = 50, 16, 1
    workspace = open_workspace(args.config)
    from transformers import AutoTokenizer

    model = next(iter(workspace.server.models.values()))
    tokenizer = AutoTokenizer.from_pretrained(workspace.root / (model.source or ""))
    text = long_prompt(tokenizer)
    figures: dict[str, float] = {"prompt_tokens": len(tokenizer.encode(text)), "prompt_chars": len(text)}
    figures |= asyncio.run(bench_input(workspace, text, args.iterations))
    print(f"input rails: +{figures['input_rails_ms_p50']} ms at p50 on {figures['prompt_tokens']} tokens",
          file=sys.stderr)
    figures |= asyncio.run(bench_output(workspace, args.clients, args.max_tokens, args.rounds))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
