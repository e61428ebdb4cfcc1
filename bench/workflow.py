"""Workflows (issue 60): steps side by side against the same steps chained, the runner's cost per step on a graph
against a chain, and a triage workflow against a single-call chain, measured in one run.

    .venv/bin/python bench/workflow.py [--quick] [--config FILE] [--runs N] [--rounds R] [--replays N] [--maps N]
                                       [--only overhead|model|replay|map ...]

Model figures run in-process on the config's default model (``inferline.yaml``: the bundled SmolLM2-135M), over a
``Runtime`` as ``inferline run`` builds one, with a database of its own in a temporary folder; greedy, and every
answer exactly ``max_tokens`` long (``ignore_eos``). OMP_WAIT_POLICY=PASSIVE, set before torch loads.

  parallel_speedup   two ``llm`` steps of 64 tokens each, ``needs: []`` on both (the engine batches them), against
                     the same two steps with the second needing the first: chained p50 / parallel p50, over N (20;
                     6 with --quick) requests of each, one at a time, interleaved (target >= 1.7). The model's
                     speculative decoding (prompt lookup in inferline.yaml) is on, as served;
                     ``parallel_speedup_no_spec`` is the same with ``speculative: false`` on both steps.
  engine_*           why: the same two prompts straight to the engine (``submit``), one after the other and both
                     at once, N/2 times; ``engine_pair_speedup`` (speculation on) and ``engine_pair_speedup_no_spec``
                     are the bounds the engine sets on the two figures above; ``engine_decode_step_ms_batch1`` and
                     ``_batch2`` are its decode step times (speculation off: a token a step; the time from a
                     request's first token to its last over the tokens between), ``engine_token_ms_batch1/2``
                     the same with speculation on (per token: a step may give several).
  step_overhead_ratio  the runner (``Runner().run``, no tracer) on a 20-step graph of no-op steps, 10 layers of
                     2 where each step needs both steps of the layer before, against a 20-stage chain of the same
                     no-op stage: the graph's time per step / the chain's, each the best of R (5; 3) repeats of
                     2,000 (500) requests, interleaved (target <= 1.3). ``step_overhead_us`` is the graph's time per
                     step, ``step_overhead_chain_us`` the chain's: the whole cost of a no-op step, nothing
                     subtracted.
  triage_vs_chain_ms_p50  32 concurrent clients (R rounds of 32 requests at once, 3; 1 with --quick), on a triage
                     workflow (a classifier ``llm`` step with a JSON Schema output, then a branch per intent that
                     answers) and on today's four-stage chain (prompt, tokenize, generate, stream) giving an answer
                     of the same length (64; 32 tokens): triage p50 - chain p50, in ms (no target). Where the time
                     goes: ``triage_classify_ms_p50`` (the classifier, a second model call before the answer
                     starts) and ``triage_answer_ms_p50`` (the branch that answered) beside
                     ``chain_answer_ms_p50`` (the chain's generate and stream stages).
  replay_reuse_speedup  ``inferline replay``'s in-process replay of N (50; 12 with --quick) ``draft_check``
                     requests, recorded here with ``content: full``, through a candidate whose judge's prompt
                     differs by one phrase: ``--full`` wall time / by-step wall time, each replay over a model of
                     its own started beforehand (no prompt in its prefix cache), 4 requests at a time (target >= 2).
                     ``replay_reused_identical``: every reused draft is the text ``--full`` wrote again;
                     ``replay_answers_identical`` how many answers the two replays share; where the time goes:
                     ``replay_output_tokens`` (the judge and redraft by step; the draft besides with --full).
  map_speedup        ``pipelines/summarize_long.yaml`` as shipped (greedy, up to 80 tokens a summary) over the same
                     8 chunks of the handbook's text, at ``concurrency: 8`` (the engine batches the chunks) against
                     ``concurrency: 1``: p50 / p50 of N (5; 2 with --quick) requests of each, one at a time,
                     interleaved (target >= 3); ``map_items_in_flight`` the most chunks summarized at once at each.
                     ``map_step_speedup`` is the same for the map step alone (its first item's start to its last
                     item's end: the combining step, the same on both, left out), and ``map_engine_speedup`` its
                     bound: the 8 chunks' prompts straight to the engine, one after the other against all at once,
                     N times (p50s); ``map_engine_speedup_no_spec`` the same without speculative decoding (which
                     the engine applies to batches of at most its ``max_batch``: one chunk at a time, not eight).
                     ``map_outputs_identical``: both gave the same summary.

The last line of stdout is one JSON object: these figures and the raw latencies (``*_ms``, one per request).
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds http.py, which would shadow the standard library's http
# package (imported by torch, httpx...) for any script run from here.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

# Must precede the torch import: OpenMP reads it once, when it loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pipeline.context import RequestContext
from pipeline.events import Done
from pipeline.loader import LoadedPipeline, load_pipeline_text
from pipeline.protocols import Engine, SamplingParams
from pipeline.registry import StageRegistry
from pipeline.runner import Pipeline, Runner
from pipeline.stage import Stage
from serving.runtime.resources import Runtime, RuntimeOptions
from serving.runtime.workspace import Workspace, open_workspace

PAIR_TOKENS = 64
NUM_LAYERS = 10
NUM_CLIENTS = 32
INPUT = "My order of two lamps never arrived, and I was charged twice for it."
SUMMARY = "Summarise the customer's message in one short paragraph."
REPLY = "Write the first lines of a polite reply to the customer."
QUESTIONS = (
    "I was charged twice for my Plus plan this month, please refund one of the charges.",
    "The app crashes every time I open the settings page on my phone.",
    "Do you have an office in Berlin I could visit?",
    "I cancelled my yearly plan last week and would like my money back.",
    "Sync stopped working after the last update and my notes are gone.",
    "What are your support hours on weekends?",
    "Please refund the $30 I paid for an add-on I never used.",
    "I cannot log in: the page says my password is wrong, but it is not.",
)
INTENT_SCHEMA = {
    "type": "object",
    "properties": {"intent": {"enum": ["refund", "tech", "other"]},
                   "urgency": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["intent", "urgency"], "additionalProperties": False,
}
BRANCHES = {"refund": "You are the billing team. Be brief and kind.",
            "tech": "You are technical support. Give numbered steps.",
            "other": "You are the support team. Answer briefly."}


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big each part is (full or quick)."""

    #: Requests of each pair pipeline (the engine's pair: half as many).
    num_runs: int
    #: Repeats of the no-op requests, and requests per repeat.
    num_repeats: int
    num_requests: int
    #: Rounds of 32 clients per side, and the answers' length there.
    num_rounds: int
    answer_tokens: int


FULL = Sizes(num_runs=20, num_repeats=5, num_requests=2000, num_rounds=3, answer_tokens=64)
QUICK = Sizes(num_runs=6, num_repeats=3, num_requests=500, num_rounds=1, answer_tokens=32)


def _llm(system: str, max_tokens: int, speculative: bool = True) -> str:
    return (f'{{system: "{system}", max_tokens: {max_tokens}, ignore_eos: true, temperature: 0'
            + ("}" if speculative else ", speculative: false}"))


def pair_yaml(name: str, chained: bool, speculative: bool = True) -> str:
    """Two model steps on the same input; *chained*: the second needs the first, else both start at once."""
    summary, reply = _llm(SUMMARY, PAIR_TOKENS, speculative), _llm(REPLY, PAIR_TOKENS, speculative)
    return (f"name: {name}\nstages:\n  - {{id: summary, type: llm, needs: [], with: {summary}}}\n"
            f"  - {{id: reply, type: llm, needs: [{'summary' if chained else ''}], with: {reply}}}\n")


def triage_yaml(answer_tokens: int) -> str:
    """A classifier step typed by a JSON Schema, then one answering branch per intent."""
    branches = "".join(
        f"  - {{id: {intent}, type: llm, needs: [classify], when: \"steps.classify.output.intent == '{intent}'\", "
        f"with: {_llm(system, answer_tokens)}}}\n" for intent, system in BRANCHES.items())
    return TRIAGE.format(schema=json.dumps(INTENT_SCHEMA)) + branches


TRIAGE = """name: triage_bench
stages:
  - id: classify
    type: llm
    with:
      system: >-
        Classify the customer's message. Examples: 'Refund my order' -> {{"intent": "refund"}};
        'The app crashes' -> {{"intent": "tech"}}; 'Where is your office?' -> {{"intent": "other"}}.
        Reply with the JSON object only.
      max_tokens: 32
      temperature: 0
      output: {{json_schema: {schema}}}
"""


def chain_yaml(answer_tokens: int) -> str:
    """Today's single-call chain, answering at the same length as a triage branch."""
    return CHAIN.format(system=BRANCHES["other"], max_tokens=answer_tokens)


CHAIN = """name: chain_bench
stages:
  - {{id: prompt, type: prompt, with: {{system: "{system}"}}}}
  - {{id: tok, type: tokenize}}
  - {{id: gen, type: generate, with: {{max_tokens: {max_tokens}, ignore_eos: true, temperature: 0}}}}
  - {{id: out, type: stream}}
"""


# The runner's cost per step.

class NoOp(Stage):
    """A step that does nothing: what is left is the runner's own cost."""

    type_name = "noop"

    async def run(self, ctx, scope) -> None:
        return None


def noop_graph_yaml(num_layers: int = NUM_LAYERS) -> str:
    """*num_layers* layers of two no-op steps; each step needs both steps of the layer before (a join)."""
    lines = []
    for layer in range(num_layers):
        needs = f"[s{layer - 1}a, s{layer - 1}b]" if layer else "[]"
        lines += [f"  - {{id: s{layer}{side}, type: noop, needs: {needs}}}" for side in "ab"]
    return "name: noop_graph\nstages:\n" + "\n".join(lines) + "\n"


def noop_chain_yaml(num_steps: int = 2 * NUM_LAYERS) -> str:
    """*num_steps* no-op stages, each after the one before."""
    return "name: noop_chain\nstages:\n" + "".join(f"  - {{id: s{i}, type: noop}}\n" for i in range(num_steps))


def noop_pipeline(text: str) -> Pipeline:
    registry = StageRegistry()
    registry.register(NoOp)
    return Pipeline(load_pipeline_text(text, "bench.yaml", registry))


async def _per_step_s(runner: Runner, pipeline: Pipeline, num_requests: int) -> float:
    num_steps = len(pipeline.stages)
    started = time.perf_counter()
    for _ in range(num_requests):
        final = await runner.run(pipeline, RequestContext.from_text(pipeline.name, "hi"))
        if not isinstance(final, Done):
            raise SystemExit(f"{pipeline.name}: {final}")
    return (time.perf_counter() - started) / (num_requests * num_steps)


async def step_overhead(num_requests: int, num_repeats: int) -> dict[str, Any]:
    runner, graph, chain = Runner(), noop_pipeline(noop_graph_yaml()), noop_pipeline(noop_chain_yaml())
    for pipeline in (graph, chain):  # warm-up
        await _per_step_s(runner, pipeline, max(1, num_requests // 10))
    graph_s, chain_s = [], []
    for _ in range(num_repeats):
        graph_s.append(await _per_step_s(runner, graph, num_requests))
        chain_s.append(await _per_step_s(runner, chain, num_requests))
    best_graph, best_chain = min(graph_s), min(chain_s)
    return {"step_overhead_ratio": round(best_graph / best_chain, 3), "step_overhead_us": round(best_graph * 1e6, 2),
            "step_overhead_chain_us": round(best_chain * 1e6, 2),
            "step_overhead_graph_us_repeats": [round(s * 1e6, 2) for s in graph_s],
            "step_overhead_chain_us_repeats": [round(s * 1e6, 2) for s in chain_s]}


# Model workflows, over a runtime.

def _p50(values: Sequence[float]) -> float:
    return round(statistics.median(values), 1)


def _stage_ms(final: Done, step_id: str) -> float:
    record = next((s for s in final.summary.stages if s.id == step_id and s.status == "ok"), None)
    if record is None:
        raise SystemExit(f"{final.summary.pipeline}: step {step_id} did not run")
    return record.duration_s * 1e3


async def _request(runtime: Runtime, name: str, text: str) -> tuple[float, Done]:
    ctx = RequestContext.from_text(name, text)
    started = time.perf_counter()
    final = await runtime.runner.run(runtime.pipelines[name], ctx)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    if not isinstance(final, Done):
        raise SystemExit(f"{name}: {final.status} ({final.kind}) at {final.stage_id}: {final.message}")
    return elapsed_ms, final


def _check_pair(final: Done, name: str) -> None:
    tokens = {s.id: s.output_tokens for s in final.summary.stages}
    if tokens != {"summary": PAIR_TOKENS, "reply": PAIR_TOKENS}:
        raise SystemExit(f"{name}: expected {PAIR_TOKENS} tokens from each step, got {tokens}")


async def parallel(runtime: Runtime, num_runs: int, suffix: str = "") -> dict[str, Any]:
    """The pair side by side against chained, interleaved (each first every other run); keys end in *suffix*."""
    names = (f"pair{suffix}", f"pair_chained{suffix}")
    for name in names:  # warm-up: kernels and the prefix cache, for both
        _check_pair((await _request(runtime, name, INPUT))[1], name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for run in range(num_runs):
        for name in names[:: 1 if run % 2 else -1]:
            elapsed_ms, final = await _request(runtime, name, INPUT)
            _check_pair(final, name)
            times[name].append(round(elapsed_ms, 1))
    parallel_ms, chained_ms = _p50(times[names[0]]), _p50(times[names[1]])
    return {f"parallel_speedup{suffix}": round(chained_ms / parallel_ms, 3), f"parallel_ms_p50{suffix}": parallel_ms,
            f"chained_ms_p50{suffix}": chained_ms, f"parallel_ms{suffix}": times[names[0]],
            f"chained_ms{suffix}": times[names[1]]}


async def _generate(engine: Engine, prompt_ids: list[int], speculative: bool) -> tuple[float, float]:
    """One request straight to the engine: its wall ms, and its ms per output token after the first."""
    sampling = SamplingParams(max_tokens=PAIR_TOKENS, temperature=0.0, ignore_eos=True, speculative=speculative)
    started = time.perf_counter()
    stream = await engine.submit(prompt_ids, sampling)
    stamps = []
    try:
        async for event in stream:
            stamps.append((time.perf_counter(), event.num_output_tokens))
    finally:
        await stream.aclose()
    (first, first_n), (last, last_n) = stamps[0], stamps[-1]
    return (last - started) * 1e3, (last - first) * 1e3 / max(1, last_n - first_n)


async def _engine_pair(engine: Engine, prompts: list[list[int]], num_runs: int, speculative: bool) -> dict[str, float]:
    """The two prompts one after the other, then both at once, *num_runs* times."""
    sequential_ms, single_token, pair_ms, pair_token = [], [], [], []
    for _ in range(num_runs):
        one = [await _generate(engine, ids, speculative) for ids in prompts]
        sequential_ms.append(sum(ms for ms, _ in one))
        single_token += [token_ms for _, token_ms in one]
        started = time.perf_counter()
        both = await asyncio.gather(*(_generate(engine, ids, speculative) for ids in prompts))
        pair_ms.append((time.perf_counter() - started) * 1e3)
        pair_token += [token_ms for _, token_ms in both]
    return {"speedup": round(statistics.median(sequential_ms) / statistics.median(pair_ms), 3),
            "sequential_ms_p50": _p50(sequential_ms), "pair_ms_p50": _p50(pair_ms),
            "token_ms_batch1": round(statistics.median(single_token), 2),
            "token_ms_batch2": round(statistics.median(pair_token), 2)}


async def engine_alone(runtime: Runtime, num_runs: int) -> dict[str, Any]:
    """The pair's two prompts straight to the engine, as the pipelines run them (the model's speculative decoding
    as configured) and without speculation, where an output token is a decode step."""
    engine = await runtime.engines.get(runtime.engines.default_model)
    prompts = [engine.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": INPUT}])
               for system in (SUMMARY, REPLY)]
    configured = await _engine_pair(engine, prompts, num_runs, speculative=True)
    plain = await _engine_pair(engine, prompts, num_runs, speculative=False)
    return {"engine_pair_speedup": configured["speedup"], "engine_sequential_ms_p50": configured["sequential_ms_p50"],
            "engine_pair_ms_p50": configured["pair_ms_p50"], "engine_token_ms_batch1": configured["token_ms_batch1"],
            "engine_token_ms_batch2": configured["token_ms_batch2"],
            "engine_pair_speedup_no_spec": plain["speedup"], "engine_decode_step_ms_batch1": plain["token_ms_batch1"],
            "engine_decode_step_ms_batch2": plain["token_ms_batch2"]}


async def _round(runtime: Runtime, name: str, num_clients: int) -> list[tuple[float, Done]]:
    return await asyncio.gather(*(_request(runtime, name, QUESTIONS[i % len(QUESTIONS)])
                                  for i in range(num_clients)))


async def triage(runtime: Runtime, num_rounds: int, num_clients: int = NUM_CLIENTS) -> dict[str, Any]:
    await _round(runtime, "chain_bench", num_clients)  # warm-up: both fill the prefix cache with their prompts
    await _round(runtime, "triage_bench", num_clients)
    ms: dict[str, list[float]] = {"triage_bench": [], "chain_bench": []}
    classify, answer, chain_answer, intents = [], [], [], Counter[str]()
    for round_ in range(num_rounds):
        for name in ("triage_bench", "chain_bench")[:: 1 if round_ % 2 else -1]:
            for elapsed_ms, final in await _round(runtime, name, num_clients):
                ms[name].append(round(elapsed_ms, 1))
                if name == "chain_bench":  # generate submits; stream reads the tokens
                    chain_answer.append(_stage_ms(final, "gen") + _stage_ms(final, "out"))
                    continue
                classify.append(_stage_ms(final, "classify"))
                branch = next(s.id for s in final.summary.stages if s.id in BRANCHES and s.status == "ok")
                intents[branch] += 1
                answer.append(_stage_ms(final, branch))
    triage_ms, chain_ms = _p50(ms["triage_bench"]), _p50(ms["chain_bench"])
    return {"triage_vs_chain_ms_p50": round(triage_ms - chain_ms, 1), "triage_ms_p50": triage_ms,
            "chain_ms_p50": chain_ms, "triage_classify_ms_p50": _p50(classify),
            "triage_answer_ms_p50": _p50(answer), "chain_answer_ms_p50": _p50(chain_answer),
            "triage_intents": dict(intents), "triage_ms": ms["triage_bench"], "chain_ms": ms["chain_bench"]}


def model_pipelines(workspace: Workspace, answer_tokens: int) -> list[LoadedPipeline]:
    texts = {"pair": pair_yaml("pair", False), "pair_chained": pair_yaml("pair_chained", True),
             "pair_no_spec": pair_yaml("pair_no_spec", False, speculative=False),
             "pair_chained_no_spec": pair_yaml("pair_chained_no_spec", True, speculative=False),
             "triage_bench": triage_yaml(answer_tokens), "chain_bench": chain_yaml(answer_tokens)}
    return [workspace.load_pipeline_text(text, f"{name}.yaml") for name, text in texts.items()]


async def model_figures(workspace: Workspace, sizes: Sizes, options: RuntimeOptions | None = None) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    async with Runtime(workspace, model_pipelines(workspace, sizes.answer_tokens),
                       options or RuntimeOptions()) as runtime:
        await runtime.engines.get(runtime.engines.default_model)
        figures |= await parallel(runtime, sizes.num_runs)
        figures |= await parallel(runtime, sizes.num_runs, suffix="_no_spec")
        figures |= await engine_alone(runtime, max(3, sizes.num_runs // 2))
        figures |= await triage(runtime, sizes.num_rounds)
    return figures


# Replay by step (issue 61): draft_check requests recorded in full, replayed after a change to the judge's prompt.

DRAFT_CHECK = Path(__file__).resolve().parents[1] / "pipelines" / "draft_check.yaml"
#: The candidate's one change: a sentence of the judge's system prompt.
JUDGE_EDIT = ("You review a support answer before it is sent.",
              "You review a support answer before it is sent to the customer.")
REPLAY_REQUESTS, REPLAY_REQUESTS_QUICK, REPLAY_CONCURRENCY = 50, 12, 4


def replay_questions(num_requests: int) -> list[str]:
    """*num_requests* different questions: the support ones, each about an order of its own."""
    return [f"{QUESTIONS[i % len(QUESTIONS)]} (Order {1000 + i}.)" for i in range(num_requests)]


async def _timed_replay(workspace: Workspace, candidate: LoadedPipeline, records: list[dict[str, Any]], full: bool,
                        options: RuntimeOptions | None) -> tuple[float, list[dict[str, Any]]]:
    """One in-process replay as ``inferline replay`` makes it, over a model of its own started before the clock
    starts (unless *options* bring engines): no prompt of the recording or of the other replay is in its prefix
    cache, as none would be a day later."""
    from serving.evals.replay import replay

    async with Runtime(workspace, [], options or RuntimeOptions()) as models:
        await models.engines.get(models.engines.default_model)
        started = time.perf_counter()
        results = await replay(workspace, candidate, records, engines=models.engines, concurrency=REPLAY_CONCURRENCY,
                               full=full)
        return time.perf_counter() - started, results


def _tokens(results: Sequence[dict[str, Any]]) -> int:
    return sum(step["new"]["output_tokens"] for r in results for step in r["steps"] if step["new"])


async def replay_reuse(workspace: Workspace, num_requests: int,
                       options: RuntimeOptions | None = None) -> dict[str, Any]:
    """*num_requests* ``draft_check`` requests served and audited in full (4 at a time), then replayed through a
    candidate whose judge's prompt differs: by step (each draft reused) against ``--full`` (every step rerun).
    The ratio of their wall times; whether every reused draft is the text ``--full`` wrote again, and how many
    answers the two replays share; the tokens each generated (where the time goes)."""
    from serving.cli.replay import read_records
    from store.audit import AuditFilters

    text = DRAFT_CHECK.read_text()
    if JUDGE_EDIT[0] not in text:
        raise SystemExit(f"{DRAFT_CHECK}: the judge's prompt no longer says {JUDGE_EDIT[0]!r}")
    served = workspace.load_pipeline_text(text, "draft_check.yaml")
    candidate = workspace.load_pipeline_text(text.replace(*JUDGE_EDIT), "draft_check_candidate.yaml")
    gate = asyncio.Semaphore(REPLAY_CONCURRENCY)
    async with Runtime(workspace, [served], options or RuntimeOptions()) as runtime:

        async def record(question: str) -> None:
            async with gate:
                await _request(runtime, served.spec.name, question)

        await asyncio.gather(*(record(question) for question in replay_questions(num_requests)))
    records, _ = read_records(workspace.database_url, AuditFilters(pipeline=served.spec.name), num_requests,
                              with_stages=True)
    seconds, results = {}, {}
    for full in (False, True):
        seconds[full], results[full] = await _timed_replay(workspace, candidate, records, full, options)
    drafts = {full: [next(s for s in r["steps"] if s["step"] == "draft") for r in results[full]] for full in results}
    reused = [draft for draft in drafts[False] if draft["run"] == "reused"]
    pairs = list(zip(drafts[False], drafts[True], strict=True))
    identical = all(draft["identical"] for draft in reused) and all(
        ours["new"]["output"] == rerun["new"]["output"] for ours, rerun in pairs)
    return {"replay_reuse_speedup": round(seconds[True] / seconds[False], 3), "replay_step_s": round(seconds[False], 2),
            "replay_full_s": round(seconds[True], 2), "replay_requests": len(records),
            "replay_drafts_reused": len(reused), "replay_reused_identical": identical,
            "replay_answers_identical": sum(ours["new"]["output"] == rerun["new"]["output"]
                                            for ours, rerun in zip(results[False], results[True], strict=True)),
            "replay_output_tokens": {"step": _tokens(results[False]), "full": _tokens(results[True])},
            "replay_steps_rerun": {"step": sum(r["reuse"]["rerun"] for r in results[False]),
                                   "full": sum(r["reuse"]["rerun"] for r in results[True])}}


# Map (issue 61): summarize_long's chunks summarized eight at a time against one at a time.

SUMMARIZE_LONG = Path(__file__).resolve().parents[1] / "pipelines" / "summarize_long.yaml"
HANDBOOK = SUMMARIZE_LONG.parent / "data" / "handbook"
MAP_CHUNKS, MAP_CONCURRENCY = 8, 8
MAP_RUNS, MAP_RUNS_QUICK = 5, 2
#: Each part of the long text: a paragraph this long, so that split (chunk_chars: 1500) gives one chunk per part.
MAP_PART_CHARS = (1000, 1300)


def map_yaml(concurrency: int) -> str:
    """``summarize_long`` as shipped, but for its map's ``concurrency`` (and its name, which says it)."""
    text = SUMMARIZE_LONG.read_text()
    shipped = f"concurrency: {MAP_CONCURRENCY}"
    if shipped not in text:
        raise SystemExit(f"{SUMMARIZE_LONG}: its map no longer says {shipped!r}")
    return text.replace(shipped, f"concurrency: {concurrency}").replace(
        "name: summarize_long", f"name: summarize_long_c{concurrency}")


def map_input(num_parts: int = MAP_CHUNKS) -> str:
    """*num_parts* paragraphs of the handbook's text (its pages in name order, whitespace made single spaces),
    each cut at a sentence's end between :data:`MAP_PART_CHARS` characters."""
    text = " ".join(" ".join(page.read_text().split()) for page in sorted(HANDBOOK.glob("*.md")))
    low, high = MAP_PART_CHARS
    parts, start = [], 0
    for _ in range(num_parts):
        end = text.rfind(". ", start + low, start + high) + 1
        if end <= 0:
            raise SystemExit(f"{HANDBOOK}: no sentence ends {low}-{high} characters after character {start}")
        parts.append(text[start:end])
        start = end + 1
    return "\n\n".join(parts)


def _map_items(final: Done) -> tuple[float, int]:
    """From the map's first item starting to its last one ending, in ms; and the most items that ran at once."""
    items = [s for s in final.summary.stages if s.id == "summarize" and s.status == "ok"]
    if len(items) != MAP_CHUNKS:
        raise SystemExit(f"{final.summary.pipeline}: {len(items)} chunks summarized, not {MAP_CHUNKS}")
    # An item's end sorts before a start at the same instant: the two did not overlap.
    edges = sorted([(s.started_s + s.duration_s, -1) for s in items] + [(s.started_s, 1) for s in items])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return (max(s.started_s + s.duration_s for s in items) - min(s.started_s for s in items)) * 1e3, most


async def _engine_map(engine: Engine, prompts: list[list[int]], max_tokens: int, num_runs: int,
                      speculative: bool) -> dict[str, float]:
    """The map's prompts straight to the engine, one after the other, then all at once, *num_runs* times: the
    bound the engine's batching sets on the map (the pipeline's sampling: greedy, each ends where the model ends
    it); p50 ms of each and their ratio."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative=speculative)

    async def one(ids: list[int]) -> None:
        stream = await engine.submit(ids, sampling)
        try:
            async for _ in stream:
                pass
        finally:
            await stream.aclose()

    sequential_ms, batched_ms = [], []
    for _ in range(num_runs):
        started = time.perf_counter()
        for ids in prompts:
            await one(ids)
        sequential_ms.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        await asyncio.gather(*(one(ids) for ids in prompts))
        batched_ms.append((time.perf_counter() - started) * 1e3)
    return {"speedup": round(statistics.median(sequential_ms) / statistics.median(batched_ms), 3),
            "sequential_ms_p50": _p50(sequential_ms), "batched_ms_p50": _p50(batched_ms)}


async def map_figures(workspace: Workspace, num_runs: int, options: RuntimeOptions | None = None) -> dict[str, Any]:
    """``summarize_long`` over the same 8 chunks at ``concurrency: 8`` and at ``concurrency: 1``, *num_runs*
    requests of each, one at a time, interleaved: the ratio of their p50 wall times (``map_speedup``), and of the
    map step's own (``map_step_speedup``: the combining step, the same on both, left out); whether both gave the
    same summaries; the engine's bound on the map (its 8 prompts sent straight to it)."""
    names = {concurrency: f"summarize_long_c{concurrency}" for concurrency in (MAP_CONCURRENCY, 1)}
    loaded = [workspace.load_pipeline_text(map_yaml(c), f"{name}.yaml") for c, name in names.items()]
    text = map_input()
    ms: dict[int, list[float]] = {c: [] for c in names}
    window: dict[int, list[float]] = {c: [] for c in names}
    in_flight = dict.fromkeys(names, 0)
    outputs: dict[int, Any] = {}
    async with Runtime(workspace, loaded, options or RuntimeOptions()) as runtime:
        for name in names.values():  # warm-up: kernels and the prefix cache (the chunks' shared system prompt)
            await _request(runtime, name, text)
        for run in range(num_runs):
            for concurrency, name in list(names.items())[:: 1 if run % 2 else -1]:
                elapsed_ms, final = await _request(runtime, name, text)
                ms[concurrency].append(round(elapsed_ms, 1))
                window_ms, most = _map_items(final)
                window[concurrency].append(round(window_ms, 1))
                in_flight[concurrency] = max(in_flight[concurrency], most)
                outputs[concurrency] = final.summary.output_text
        engine = await runtime.engines.get(runtime.engines.default_model)
        step = next(s for s in loaded[0].spec.stages if s.id == "summarize").with_
        prompts = [engine.tokenizer.encode_chat([{"role": "system", "content": step["system"]},
                                                 {"role": "user", "content": chunk}]) for chunk in text.split("\n\n")]
        bound = {f"map_engine_{key}{suffix}": value
                 for suffix, speculative in (("", True), ("_no_spec", False))
                 for key, value in (await _engine_map(engine, prompts, step["max_tokens"], num_runs,
                                                      speculative)).items()}
    wide, narrow = MAP_CONCURRENCY, 1
    return {"map_speedup": round(_p50(ms[narrow]) / _p50(ms[wide]), 3),
            "map_step_speedup": round(_p50(window[narrow]) / _p50(window[wide]), 3), **bound,
            "map_chunks": MAP_CHUNKS, "map_outputs_identical": outputs[wide] == outputs[narrow],
            "map_items_in_flight": {f"concurrency_{c}": most for c, most in in_flight.items()},
            "map_ms_p50": _p50(ms[wide]), "map_serial_ms_p50": _p50(ms[narrow]),
            "map_step_ms_p50": _p50(window[wide]), "map_step_serial_ms_p50": _p50(window[narrow]),
            "map_ms": ms[wide], "map_serial_ms": ms[narrow]}


#: What ``--only`` picks, with the headline figures of each (and their engine bounds).
PARTS = {"overhead": ("step_overhead_ratio",),
         "model": ("parallel_speedup", "engine_pair_speedup", "triage_vs_chain_ms_p50"),
         "replay": ("replay_reuse_speedup",),
         "map": ("map_speedup", "map_step_speedup", "map_engine_speedup")}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (make bench, CI)")
    parser.add_argument("--config", default="inferline.yaml", help="the server config (default: inferline.yaml)")
    parser.add_argument("--runs", type=int, help="requests of each pair pipeline (default 20; 6 with --quick)")
    parser.add_argument("--rounds", type=int, help="rounds of 32 clients per side (default 3; 1 with --quick)")
    parser.add_argument("--replays", type=int, help="draft_check requests recorded and replayed (default 50; 12 "
                                                    "with --quick)")
    parser.add_argument("--maps", type=int, help="summarize_long requests at each concurrency (default 5; 2 with "
                                                 "--quick)")
    parser.add_argument("--only", action="append", choices=PARTS,
                        help="measure only this part (again for several): " + ", ".join(
                            f"{part} ({', '.join(keys)})" for part, keys in PARTS.items()))
    args = parser.parse_args(argv)
    parts = args.only or list(PARTS)
    sizes = QUICK if args.quick else FULL
    sizes = Sizes(args.runs or sizes.num_runs, sizes.num_repeats, sizes.num_requests, args.rounds or sizes.num_rounds,
                  sizes.answer_tokens)
    started = time.perf_counter()
    figures = asyncio.run(step_overhead(sizes.num_requests, sizes.num_repeats)) if "overhead" in parts else {}
    workspace = open_workspace(args.config)
    with tempfile.TemporaryDirectory(prefix="bench-workflow-") as folder:
        # A database of its own: nothing of the bench's lands in the server's.
        database = f"sqlite:///{Path(folder) / 'bench.db'}"
        workspace = replace(workspace, server=workspace.server.model_copy(update={"database": database}))
        if "model" in parts:
            figures |= asyncio.run(model_figures(workspace, sizes))
        if "replay" in parts:
            figures |= asyncio.run(replay_reuse(workspace, args.replays or (REPLAY_REQUESTS_QUICK if args.quick
                                                                            else REPLAY_REQUESTS)))
        if "map" in parts:
            figures |= asyncio.run(map_figures(workspace, args.maps or (MAP_RUNS_QUICK if args.quick else MAP_RUNS)))
    figures["quick"] = args.quick
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    return figures


if __name__ == "__main__":
    result = main()
    print(", ".join(f"{key} {result[key]}" for keys in PARTS.values() for key in keys if key in result),
          file=sys.stderr)
    print(json.dumps(result))
