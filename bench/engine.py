"""Our engine against Hugging Face baselines: throughput, latency and memory, measured in one run.

    .venv/bin/python bench/engine.py [--quick] [--only {hf,ours}] [--model DIR] [--seed N]

Everything runs on SmolLM2-135M-Instruct in float32 on the CPU with 2 torch threads, greedy, and with
OMP_WAIT_POLICY=PASSIVE for both sides (the engine package sets it; this script sets it before torch loads so
the baselines run under the same policy). Prompts are slices of the token ids of a repeated passage of English
text, and the same id lists go to HF and to our engine. Each workload prints a table as it runs. The last line
of output is one JSON object: the ratios below, the raw figures (``*_tok_s`` = output tokens / wall seconds,
``*_ttft_s`` in seconds), ``timings_s`` (how long each part took) and ``notes`` (each part that could not run,
and why). A ratio is null when either of its figures is missing. ``--quick`` runs the smaller sizes in brackets.
Baselines and ours run one after the other, not interleaved: on a shared machine, compare ratios across runs
with care and look at ``timings_s``.

Mixed: 64 requests (16) submitted at once; prompts uniformly 64-512 tokens, max_tokens uniformly 16-256
(16-64), from a fixed seed; EOS ignored (HF: min_new_tokens = max_new_tokens; ours: ``ignore_eos``).
  hf_sequential   HF ``generate`` one request at a time. At 10-20 tok/s the whole set would take too long, so it
                  runs a representative subset, 12 requests (6) at evenly spaced quantiles of max_tokens, and
                  reports that subset's tok/s.
  hf_static       HF ``generate`` on left-padded batches of 16 in arrival order. Each batch runs to its longest
                  max_tokens; only the tokens each request asked for count as output. A request's TTFT is its
                  batch's first-token time minus the start of the burst.
  hf_continuous   transformers' continuous batching. ``generate_batch`` takes one max_new_tokens for all
                  requests, so this drives the manager it wraps (``continuous_batching_context_manager`` and
                  ``add_request(max_new_tokens=..., eos_token_id=-1)``) to give each request its own limit. Sized
                  like ours (max_batch_tokens 512, max_requests_per_batch 64) plus enough 256-token pages for the
                  whole workload, so it never preempts; left to itself on a CPU it sizes its cache and attention
                  mask from 90% of system RAM with 8192-token batches. Its warm-up is not timed. On a CPU it has
                  no paged kernel: SDPA runs over the whole packed batch with a block-diagonal mask, so attention
                  work grows with (queries in the step) x (KV tokens of every request in the step).
  ours            ``LLMEngine.generate`` with all requests at once (max_num_seqs 64, max_num_batched_tokens 512).
  vs_hf_sequential, vs_hf_static, vs_hf_continuous = ours tok/s / that baseline's tok/s.

Uniform: 32 requests (16), 128-token prompts, 128 new tokens (64), all at once.
  hf_static32     HF ``generate`` on one batch of all of them; TTFT = when its first tokens appear (a streamer).
  vs_hf_static32_uniform = ours tok/s / hf_static32 tok/s.
  burst_ttft_vs_hf_static = our mean TTFT over the burst / hf_static32 TTFT (target <= 0.5).

Decode: one request alone, a 32-token prompt and 128 new tokens; best of 3 (2) runs per side.
  decode_vs_hf = ours tok/s / HF tok/s.
  decode_vs_bound = ours tok/s / (read bandwidth / weight bytes read per step). Read bandwidth: the median
  of several measurements in this run (``read_bandwidth_gb_s_samples``), each the best of 5 ``x.sum()``
  over a 1 GiB float32 tensor: one before HF's runs, one before each of ours and one after the last. A
  shared machine's bandwidth drifts by more than the margin of this ratio (one measurement on an AMD
  Zen 4 said 54 GB/s, the next twenty 31-36), so the bound is the machine's while ours ran, not one
  moment's. Bytes per step: every parameter once; the tied
  embedding / lm_head matrix counts once (the lm_head matmul reads all of it, the embedding lookup one row).
  The KV cache is not counted.

Prefix reuse: a 1,024-token system prompt (chat format) then 32 (4) different questions of 16-32 tokens,
8 new tokens each, submitted one after another so each TTFT is clean; one untimed warm-up question first
(it also fills the prefix cache).
  prefix_ttft_speedup = median TTFT with our prefix cache off / on (two engines).
  For orientation, HF: the prefix prefilled once into a DynamicCache, ``copy.deepcopy``-ed per question (the
  copy counts in TTFT, the one-off prefill does not) against no cache; prefix_hf_cache_speedup = off / on.

Memory: 1,000 (200) short requests (prompts 16-64 tokens, 4-16 new tokens) in waves of 50 at once, after a
warm-up wave of 50. rss_growth = (VmRSS after - VmRSS before) / VmRSS before.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds http.py, which would shadow the standard library's http
# package (imported by torch, httpx...) for any script run from here.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import contextlib
import copy
import gc
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Must precede the torch import: OpenMP reads it once, when it loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
    DynamicCache,
    GenerationConfig,
)
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

log = logging.getLogger("bench.engine")

MODEL_DIR = "models/smollm2-135m-instruct"
NUM_THREADS = 2
#: Where our engine runs (``--device``); on cuda in bfloat16, and the HF baselines are skipped.
DEVICE = "cpu"
STATIC_BATCH = 16
MAX_NUM_SEQS = 64
MAX_BATCHED_TOKENS = 512
CB_PAGE_SIZE = 256
PREFIX_LEN = 1024
PREFIX_NEW_TOKENS = 8
DECODE_PROMPT_LEN = 32
DECODE_NEW_TOKENS = 128
UNIFORM_PROMPT_LEN = 128
MEMORY_WAVE = 50

RATIO_KEYS = (
    "vs_hf_sequential", "vs_hf_static", "vs_hf_static32_uniform", "vs_hf_continuous", "burst_ttft_vs_hf_static",
    "decode_vs_hf", "decode_vs_bound", "prefix_ttft_speedup", "rss_growth",
)
MIXED_KEYS = (
    "mixed_hf_sequential_tok_s", "mixed_hf_sequential_num_requests", "mixed_hf_static_tok_s",
    "mixed_hf_static_mean_ttft_s", "mixed_hf_continuous_tok_s", "mixed_hf_continuous_mean_ttft_s",
    "mixed_ours_tok_s", "mixed_ours_mean_ttft_s",
)
UNIFORM_KEYS = ("uniform_hf_static32_tok_s", "uniform_hf_static32_ttft_s", "uniform_ours_tok_s",
                "uniform_ours_mean_ttft_s")
DECODE_KEYS = ("decode_hf_tok_s", "decode_ours_tok_s", "read_bandwidth_gb_s", "weight_bytes_per_step",
               "decode_bound_tok_s")
PREFIX_KEYS = ("prefix_hf_no_cache_median_ttft_s", "prefix_hf_copied_cache_median_ttft_s", "prefix_hf_cache_speedup",
               "prefix_ours_off_median_ttft_s", "prefix_ours_on_median_ttft_s")
MEMORY_KEYS = ("rss_before_bytes", "rss_after_bytes", "memory_num_requests")

PASSAGE = """\
The lighthouse keeper kept a logbook of every ship that passed the point, noting the wind, the state of the sea and
the colour of the sky at dusk. In winter the lamp had to be trimmed three times a night, and the brass fittings
turned green within a week if nobody polished them. When the light was finally automated, the logbooks went to the
county archive, where historians now use them to reconstruct storms that no instrument recorded.

Sourdough bread depends on a starter, a living culture of wild yeast and lactic acid bacteria that bakers feed with
flour and water. A lively starter doubles in a few hours at room temperature; a sluggish one smells of acetone and
needs more frequent feeding. The long fermentation gives the loaf its open crumb and sour tang, and it also breaks
down some of the compounds that make ordinary bread hard for certain people to digest.

Every autumn, millions of small songbirds cross the Mediterranean and the Sahara in a handful of nights. They fly
mostly in the dark, navigating by the stars, the setting sun and the Earth's magnetic field, and they rest in oases
during the day. Before departure they nearly double their body weight, storing fat that they burn almost completely
on the way. Radar stations built for aircraft were among the first tools to reveal the scale of these journeys.

The printing press spread across Europe with remarkable speed in the second half of the fifteenth century. Within
fifty years there were presses in more than two hundred cities, and the price of a book fell so far that a skilled
craftsman could afford one. Printers standardised spelling, numbered pages and added title pages, habits that
scribes had never needed, and pamphlets turned religious and political arguments into public events.

A city's water system is mostly invisible until it fails. Reservoirs and treatment plants are only the beginning:
thousands of kilometres of pipes, some more than a century old, carry water under pressure to every tap, and a
single main break can lose millions of litres in an afternoon. Engineers listen for leaks with acoustic sensors at
night, when the streets are quiet, and replace the oldest cast-iron sections before they crack in a hard frost.

Chess openings have names that record their history: the Sicilian, the French and the Queen's Gambit were studied
long before computers. Modern engines have overturned some old verdicts and rescued lines that masters had dismissed
as unsound. Even so, most club players lose games not in the opening but in the middlegame, by overlooking a simple
capture, and coaches still recommend solving tactical puzzles every day rather than memorising long variations.
"""

TOPICS = (
    "the lighthouse logbooks", "polishing the brass fittings", "automating the light", "the sourdough starter",
    "long fermentation", "songbird migration", "how birds navigate at night", "radar and migrating birds",
    "the spread of printing presses", "pamphlets and public arguments", "old cast-iron water mains",
)
QUESTION_FORMS = (
    "According to the notes above, what do they say about {topic}? Please answer in one short sentence.",
    "In a few words, what do the notes above explain about {topic}, and why does it matter?",
    "Is there anything surprising in the notes above about {topic}? Reply briefly.",
)


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big each workload is (full or quick)."""

    num_mixed: int
    mixed_max_tokens: tuple[int, int]
    num_sequential: int
    num_uniform: int
    uniform_new_tokens: int
    num_decode_repeats: int
    num_questions: int
    num_memory: int


FULL = Sizes(64, (16, 256), 12, 32, 128, 3, 32, 1000)
QUICK = Sizes(16, (16, 64), 6, 16, 64, 2, 4, 200)


@dataclass(frozen=True, slots=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class Run:
    """One measured burst: output tokens, wall time, and per-request TTFTs when known."""

    num_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.num_tokens / self.wall_s

    @property
    def mean_ttft_s(self) -> float | None:
        return statistics.fmean(self.ttft_s) if self.ttft_s else None


class Report:
    """Figures, notes and part timings; a failed part leaves its figures null and the others still run."""

    def __init__(self) -> None:
        keys = RATIO_KEYS + MIXED_KEYS + UNIFORM_KEYS + DECODE_KEYS + PREFIX_KEYS + MEMORY_KEYS
        self.figures: dict[str, float | None] = dict.fromkeys(keys)
        self.notes: list[str] = []
        self.timings_s: dict[str, float] = {}

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        log.info("%s ...", name)
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:  # a benchmark reports what it could measure rather than stopping
            log.exception("%s failed", name)
            self.notes.append(f"{name}: {type(exc).__name__}: {exc}")
        finally:
            # a part run more than once (the decode's bandwidth, between runs) counts its total
            self.timings_s[name] = round(self.timings_s.get(name, 0.0) + time.perf_counter() - start, 1)
            log.info("%s took %.1f s", name, self.timings_s[name])

    def table(self, title: str, keys: Sequence[str]) -> None:
        print(f"\n== {title} ==", flush=True)
        for key in keys:
            print(f"  {key:<40} {_fmt(self.figures.get(key))}", flush=True)


@dataclass(slots=True)
class Bench:
    """What every workload needs: sizes, the HF model, our engine (None when unavailable), the report."""

    sizes: Sizes
    seed: int
    model_dir: str
    model: Any
    tokenizer: Any
    pool: list[int]
    report: Report
    run_hf: bool
    engine: Any = None
    engine_error: str | None = None


def _fmt(value: float | None) -> str:
    if value is None:
        return "null"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


# ---------------------------------------------------------------------------------------------- workload data


def text_pool(tokenizer: Any, num_tokens: int) -> list[int]:
    """Token ids of the passage, repeated until there are ``num_tokens``."""
    ids = tokenizer.encode(PASSAGE, add_special_tokens=False)
    sep = tokenizer.encode("\n\n", add_special_tokens=False)
    return ((ids + sep) * math.ceil(num_tokens / len(ids)))[:num_tokens]


def _slice(pool: list[int], rng: random.Random, length: int) -> list[int]:
    start = rng.randrange(len(pool) - length)
    return pool[start : start + length]


def mixed_requests(pool: list[int], sizes: Sizes, rng: random.Random) -> list[Request]:
    lo, hi = sizes.mixed_max_tokens
    return [Request(_slice(pool, rng, rng.randint(64, 512)), rng.randint(lo, hi)) for _ in range(sizes.num_mixed)]


def representative(requests: Sequence[Request], num: int) -> list[Request]:
    """``num`` requests at evenly spaced quantiles of max_tokens, in arrival order."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].max_tokens)
    picks = sorted({order[int((k + 0.5) * len(order) / num)] for k in range(num)})
    return [requests[i] for i in picks]


def prefix_ids(tokenizer: Any, pool: list[int]) -> list[int]:
    """A chat-format system turn of exactly PREFIX_LEN tokens that ends where the user's question starts."""
    head = tokenizer.encode("<|im_start|>system\nAnswer questions about these notes.\n\n", add_special_tokens=False)
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>user\n", add_special_tokens=False)
    return head + pool[: PREFIX_LEN - len(head) - len(tail)] + tail


def question_ids(tokenizer: Any, num: int) -> list[list[int]]:
    """``num`` distinct questions, each closed by the assistant turn's header."""
    texts = [form.format(topic=topic) for topic in TOPICS for form in QUESTION_FORMS]
    if num > len(texts):
        raise ValueError(f"only {len(texts)} distinct questions, {num} asked for")
    suffix = "<|im_end|>\n<|im_start|>assistant\n"
    return [tokenizer.encode(text + suffix, add_special_tokens=False) for text in texts[:num]]


# ---------------------------------------------------------------------------------------------- HF baselines


class FirstTokenClock(BaseStreamer):
    """Notes when ``generate`` emits its first new tokens (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def hf_generate(model: Any, batch: Sequence[Request], pad_id: int, cache: Any = None) -> float:
    """Run one left-padded batch to its longest max_tokens, EOS suppressed; return the first token's time."""
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, request in enumerate(batch):
        ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
        mask[row, width - len(request.prompt_ids) :] = 1
    num_new = max(r.max_tokens for r in batch)
    config = GenerationConfig(max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False, pad_token_id=pad_id)
    clock = FirstTokenClock()
    extra = {} if cache is None else {"cache": cache}
    model.generate(input_ids=ids, attention_mask=mask, generation_config=config, streamer=clock, **extra)
    return clock.first_token_at


def hf_sequential(model: Any, requests: Sequence[Request], pad_id: int) -> Run:
    start = time.perf_counter()
    for request in requests:
        hf_generate(model, [request], pad_id)
    return Run(sum(r.max_tokens for r in requests), time.perf_counter() - start)


def hf_static(model: Any, requests: Sequence[Request], pad_id: int, batch_size: int) -> Run:
    """Batches in arrival order; a request's TTFT is its batch's first token since the burst began."""
    start = time.perf_counter()
    ttft_s: list[float] = []
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        first_token_at = hf_generate(model, batch, pad_id)
        ttft_s += [first_token_at - start] * len(batch)
    return Run(sum(r.max_tokens for r in requests), time.perf_counter() - start, ttft_s)


def hf_continuous(model: Any, requests: Sequence[Request]) -> Run:
    """transformers' continuous batching, each request with its own max_new_tokens; warm-up not timed."""
    num_pages = sum(math.ceil((len(r.prompt_ids) + r.max_tokens) / CB_PAGE_SIZE) for r in requests) + 8
    cb_config = ContinuousBatchingConfig(page_size=CB_PAGE_SIZE, num_blocks=num_pages,
                                         max_batch_tokens=MAX_BATCHED_TOKENS, max_requests_per_batch=MAX_NUM_SEQS)
    gen_config = GenerationConfig(max_new_tokens=max(r.max_tokens for r in requests), do_sample=False,
                                  eos_token_id=-1)
    with model.continuous_batching_context_manager(generation_config=gen_config, continuous_batching_config=cb_config,
                                                   warmup=True) as manager:
        start = time.perf_counter()
        for request in requests:
            manager.add_request(request.prompt_ids, max_new_tokens=request.max_tokens, eos_token_id=-1,
                                record_timestamps=True)
        outputs = _collect(manager, len(requests))
        wall_s = time.perf_counter() - start
    errors = [out.error for out in outputs if out.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    ttft_s = [out.timestamps[0] - start for out in outputs if out.timestamps]
    return Run(sum(len(out.generated_tokens) for out in outputs), wall_s, ttft_s)


def _collect(manager: Any, num_requests: int) -> list[Any]:
    finished: dict[str, Any] = {}
    while len(finished) < num_requests:
        out = manager.get_result(timeout=1)
        if out is None and not manager.is_running():
            raise RuntimeError(f"generation thread stopped with {len(finished)}/{num_requests} requests done")
        if out is not None and out.is_finished():
            finished[out.request_id] = out
    return list(finished.values())


def hf_prefix_ttfts(model: Any, prefix: list[int], questions: Sequence[list[int]], pad_id: int,
                    ) -> tuple[list[float], list[float]]:
    """TTFTs without a cache and with a deep copy of a prefilled prefix cache, interleaved per question."""
    prefix_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prefix]), cache=prefix_cache, use_cache=True)
    no_cache, copied = [], []
    for question in questions:
        request = Request(prefix + question, PREFIX_NEW_TOKENS)
        start = time.perf_counter()
        no_cache.append(hf_generate(model, [request], pad_id) - start)
        start = time.perf_counter()
        copied.append(hf_generate(model, [request], pad_id, cache=copy.deepcopy(prefix_cache)) - start)
    return no_cache, copied


def read_bandwidth_gb_s(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best of ``repeats`` full reads (``x.sum()``) of a float32 tensor of ``num_bytes``."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    best_s = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best_s = min(best_s, time.perf_counter() - start)
    return num_bytes / best_s / 1e9


def weight_bytes(model: Any) -> int:
    """Bytes of all parameters; ``parameters()`` yields the tied embedding / lm_head matrix once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------------------------------------- our engine


def load_engine(model_dir: str, enable_prefix_caching: bool = True) -> Any:
    from serving.engine.config import EngineConfig
    from serving.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=model_dir, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                                  enable_prefix_caching=enable_prefix_caching, num_threads=NUM_THREADS,
                                  device=DEVICE, dtype="bfloat16" if DEVICE == "cuda" else "float32"))


def ours_run(engine: Any, requests: Sequence[Request]) -> Run:
    """All of ``requests`` at once, greedy, EOS ignored; checks each got the tokens it asked for."""
    from serving.engine.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outs = engine.generate([r.prompt_ids for r in requests], params)
    wall_s = time.perf_counter() - start
    short = [(len(o.token_ids), r.max_tokens) for o, r in zip(outs, requests, strict=True)
             if len(o.token_ids) != r.max_tokens]
    if short:
        raise RuntimeError(f"{len(short)} outputs have the wrong length (got, asked): {short[:3]}")
    return Run(sum(len(o.token_ids) for o in outs), wall_s, [o.ttft_s for o in outs])


def ours_prefix_ttfts(engine: Any, prefix: list[int], questions: Sequence[list[int]]) -> list[float]:
    """One request at a time; the first (a warm-up that fills the prefix cache) is not counted."""
    ttft_s = [ours_run(engine, [Request(prefix + q, PREFIX_NEW_TOKENS)]).ttft_s[0] for q in questions]
    return ttft_s[1:]


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# ---------------------------------------------------------------------------------------------- workloads


def mixed_workload(b: Bench) -> None:
    requests = mixed_requests(b.pool, b.sizes, random.Random(b.seed))
    subset = representative(requests, b.sizes.num_sequential)
    f, pad_id = b.report.figures, b.tokenizer.pad_token_id
    if b.run_hf:
        with b.report.part("mixed/hf_sequential"):
            f["mixed_hf_sequential_tok_s"] = hf_sequential(b.model, subset, pad_id).tok_s
            f["mixed_hf_sequential_num_requests"] = len(subset)
        with b.report.part("mixed/hf_static"):
            run = hf_static(b.model, requests, pad_id, STATIC_BATCH)
            f["mixed_hf_static_tok_s"], f["mixed_hf_static_mean_ttft_s"] = run.tok_s, run.mean_ttft_s
        with b.report.part("mixed/hf_continuous"):
            run = hf_continuous(b.model, requests)
            f["mixed_hf_continuous_tok_s"], f["mixed_hf_continuous_mean_ttft_s"] = run.tok_s, run.mean_ttft_s
    if b.engine is not None:
        with b.report.part("mixed/ours"):
            run = ours_run(b.engine, requests)
            f["mixed_ours_tok_s"], f["mixed_ours_mean_ttft_s"] = run.tok_s, run.mean_ttft_s
    lo, hi = b.sizes.mixed_max_tokens
    b.report.table(f"Mixed: {len(requests)} requests at once, prompts 64-512, max_tokens {lo}-{hi}", MIXED_KEYS)


def uniform_workload(b: Bench) -> None:
    rng = random.Random(b.seed + 1)
    requests = [Request(_slice(b.pool, rng, UNIFORM_PROMPT_LEN), b.sizes.uniform_new_tokens)
                for _ in range(b.sizes.num_uniform)]
    f = b.report.figures
    if b.run_hf:
        with b.report.part("uniform/hf_static32"):
            run = hf_static(b.model, requests, b.tokenizer.pad_token_id, len(requests))
            f["uniform_hf_static32_tok_s"], f["uniform_hf_static32_ttft_s"] = run.tok_s, run.ttft_s[0]
    if b.engine is not None:
        with b.report.part("uniform/ours"):
            run = ours_run(b.engine, requests)
            f["uniform_ours_tok_s"], f["uniform_ours_mean_ttft_s"] = run.tok_s, run.mean_ttft_s
    title = f"Uniform: {len(requests)} requests, {UNIFORM_PROMPT_LEN}-token prompts, {b.sizes.uniform_new_tokens} new"
    b.report.table(title, UNIFORM_KEYS)


def decode_workload(b: Bench) -> None:
    request = Request(_slice(b.pool, random.Random(b.seed + 2), DECODE_PROMPT_LEN), DECODE_NEW_TOKENS)
    repeats, f = b.sizes.num_decode_repeats, b.report.figures
    bandwidth: list[float] = []  # the bound is the CPU's: on a GPU, decode_vs_bound stays null

    def measure_bandwidth() -> None:
        if DEVICE == "cpu":
            with b.report.part("decode/bandwidth"):
                bandwidth.append(round(read_bandwidth_gb_s(), 2))

    measure_bandwidth()
    if b.run_hf:
        with b.report.part("decode/hf"):
            pad_id = b.tokenizer.pad_token_id
            f["decode_hf_tok_s"] = max(hf_sequential(b.model, [request], pad_id).tok_s for _ in range(repeats))
    if b.engine is not None:
        runs = []
        for _ in range(repeats):
            measure_bandwidth()
            with b.report.part("decode/ours"):
                runs.append(ours_run(b.engine, [request]).tok_s)
        measure_bandwidth()
        if runs:
            f["decode_ours_tok_s"] = max(runs)
    if bandwidth:
        f["read_bandwidth_gb_s"] = statistics.median(bandwidth)
        f["read_bandwidth_gb_s_samples"] = bandwidth
        f["weight_bytes_per_step"] = weight_bytes(b.model)
        f["decode_bound_tok_s"] = f["read_bandwidth_gb_s"] * 1e9 / f["weight_bytes_per_step"]
    b.report.table(f"Decode: one request, {DECODE_PROMPT_LEN}-token prompt, {DECODE_NEW_TOKENS} new", DECODE_KEYS)


def prefix_workload(b: Bench) -> None:
    prefix = prefix_ids(b.tokenizer, b.pool)
    questions = question_ids(b.tokenizer, b.sizes.num_questions + 1)  # the first is the untimed warm-up
    f = b.report.figures
    if b.run_hf:
        with b.report.part("prefix/hf"):
            no_cache, copied = hf_prefix_ttfts(b.model, prefix, questions[1:], b.tokenizer.pad_token_id)
            f["prefix_hf_no_cache_median_ttft_s"] = statistics.median(no_cache)
            f["prefix_hf_copied_cache_median_ttft_s"] = statistics.median(copied)
            f["prefix_hf_cache_speedup"] = _ratio(statistics.median(no_cache), statistics.median(copied))
    if b.engine is not None:
        with b.report.part("prefix/ours_on"):
            f["prefix_ours_on_median_ttft_s"] = statistics.median(ours_prefix_ttfts(b.engine, prefix, questions))
        with b.report.part("prefix/ours_off"):
            engine_off = load_engine(b.model_dir, enable_prefix_caching=False)
            f["prefix_ours_off_median_ttft_s"] = statistics.median(ours_prefix_ttfts(engine_off, prefix, questions))
            del engine_off
            gc.collect()
    title = f"Prefix reuse: {PREFIX_LEN}-token system prompt, {len(questions) - 1} questions one after another"
    b.report.table(title, PREFIX_KEYS)


def memory_workload(b: Bench) -> None:
    if b.engine is None:
        return
    rng = random.Random(b.seed + 3)
    num_waves = 1 + math.ceil(b.sizes.num_memory / MEMORY_WAVE)  # the first is the warm-up
    waves = [[Request(_slice(b.pool, rng, rng.randint(16, 64)), rng.randint(4, 16)) for _ in range(MEMORY_WAVE)]
             for _ in range(num_waves)]
    f = b.report.figures
    with b.report.part("memory/ours"):
        ours_run(b.engine, waves[0])
        gc.collect()
        f["rss_before_bytes"] = rss_bytes()
        for wave in waves[1:]:
            ours_run(b.engine, wave)
        gc.collect()
        f["rss_after_bytes"] = rss_bytes()
        f["memory_num_requests"] = MEMORY_WAVE * (num_waves - 1)
    b.report.table(f"Memory: {MEMORY_WAVE * (num_waves - 1)} short requests after a warm-up of {MEMORY_WAVE}",
                   MEMORY_KEYS)


# ---------------------------------------------------------------------------------------------- main


def compute_ratios(f: dict[str, float | None]) -> None:
    f["vs_hf_sequential"] = _ratio(f["mixed_ours_tok_s"], f["mixed_hf_sequential_tok_s"])
    f["vs_hf_static"] = _ratio(f["mixed_ours_tok_s"], f["mixed_hf_static_tok_s"])
    f["vs_hf_continuous"] = _ratio(f["mixed_ours_tok_s"], f["mixed_hf_continuous_tok_s"])
    f["vs_hf_static32_uniform"] = _ratio(f["uniform_ours_tok_s"], f["uniform_hf_static32_tok_s"])
    f["burst_ttft_vs_hf_static"] = _ratio(f["uniform_ours_mean_ttft_s"], f["uniform_hf_static32_ttft_s"])
    f["decode_vs_hf"] = _ratio(f["decode_ours_tok_s"], f["decode_hf_tok_s"])
    f["decode_vs_bound"] = _ratio(f["decode_ours_tok_s"], f["decode_bound_tok_s"])
    f["prefix_ttft_speedup"] = _ratio(f["prefix_ours_off_median_ttft_s"], f["prefix_ours_on_median_ttft_s"])
    before, after = f["rss_before_bytes"], f["rss_after_bytes"]
    f["rss_growth"] = None if before is None or after is None else (after - before) / before


def setup(args: argparse.Namespace) -> Bench:
    report = Report()
    with report.part("load/hf"):
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    pool = text_pool(tokenizer, 4096)
    sizes = QUICK if args.quick else FULL
    b = Bench(sizes, args.seed, args.model, model, tokenizer, pool, report, run_hf=args.only != "ours")
    warmup = [Request(pool[:64], 8), Request(pool[64:96], 8)]
    if b.run_hf:
        hf_static(model, warmup, tokenizer.pad_token_id, len(warmup))
    if args.only != "hf":
        start_engine(b, warmup)
    return b


def start_engine(b: Bench, warmup: Sequence[Request]) -> None:
    """Load and warm up our engine; on any failure ``b.engine`` stays None and every ours figure is null."""
    with b.report.part("load/ours"):
        try:
            engine = load_engine(b.model_dir)
        except ImportError as exc:
            b.engine_error = f"our engine is not importable yet ({type(exc).__name__}: {exc})"
            b.report.notes.append(f"load/ours: {b.engine_error}")
        else:
            ours_run(engine, warmup)
            b.engine = engine
    if b.engine is None:
        b.engine_error = b.engine_error or "our engine failed to start or warm up (traceback above)"
        print(f"ERROR: {b.engine_error}; skipping every 'ours' part, their figures are null", file=sys.stderr,
              flush=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Workloads and ratios: see the module docstring (bench/engine.py).")
    parser.add_argument("--quick", action="store_true", help="smaller workloads: under five minutes on 2 cores")
    parser.add_argument("--only", choices=("hf", "ours"), help="run only the HF baselines, or only our engine")
    parser.add_argument("--model", default=MODEL_DIR, help=f"HF model folder (default: {MODEL_DIR})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workloads' prompts and lengths")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where our engine runs (cuda: bfloat16, our engine only; compare with a cpu run)")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")
        args.only = "ours"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(NUM_THREADS)
    started = time.perf_counter()
    b = setup(args)
    for workload in (mixed_workload, uniform_workload, decode_workload, prefix_workload, memory_workload):
        workload(b)
    compute_ratios(b.report.figures)
    b.report.table("Ratios", RATIO_KEYS)
    b.report.timings_s["total"] = round(time.perf_counter() - started, 1)
    return {**b.report.figures, "quick": args.quick, "device": DEVICE, "sizes": asdict(b.sizes),
            "torch_threads": NUM_THREADS,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "timings_s": b.report.timings_s,
            "notes": b.report.notes}


if __name__ == "__main__":
    result = main()
    print(json.dumps({k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in result.items()}), flush=True)
