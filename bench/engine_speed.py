"""Our engine against the CPU reference users would pick instead: llama.cpp on the same SmolLM2 GGUF.

    .venv/bin/python bench/engine_speed.py [--llamacpp] [--quick] [--only SECTION[,SECTION]] [--seed N]

Without ``--llamacpp`` only our engine runs and every llama.cpp figure (and ratio) is null. With it, llama.cpp
runs through llama-cpp-python (the optional ``bench`` extra: ``make bench-deps``, which compiles llama.cpp for
about 12 minutes) on ``models/smollm2-135m-instruct/model.gguf``, the Q4_1 file scripts/fetch_model.py
de-quantized into the float32 folder our engine loads. So both sides run the same weights: ours on that same
file in its own blocks (``dtype: gguf``, serving/engine/blocks.py: the headline ratios ``decode_vs_llamacpp``,
``parallel32_vs_llamacpp``, ``rss_vs_llamacpp``) and in float32 from the de-quantized folder
(``vs_llamacpp_*``), llama.cpp in Q4_1 (its usual CPU format) through ggml.

Both sides: SmolLM2-135M-Instruct, greedy, EOS ignored, 2 threads, OMP_WAIT_POLICY=PASSIVE (set before torch
loads; it applies to llama.cpp's OpenMP pool too). Prompts are token ids from bench/engine.py's workload data
(loaded from that file), and the same id lists go to both sides. ``*_tok_s`` = output tokens / wall seconds,
first prefill included; ``vs_llamacpp_*`` = ours / llama.cpp (above 1: we are faster). The last line of output
is one JSON object: the figures, ``timings_s`` (how long each section took) and ``notes`` (what could not run,
and why). ``--quick`` runs the smaller sizes in brackets. Each side is warmed up before it is timed; the two
sides run one after the other, so on a shared machine compare ratios across runs with care.

The wait policy weighs heavily on llama.cpp: its 2 OpenMP threads meet at a barrier per graph step. PASSIVE keeps
it steady under contention (about 55-65 tok/s at batch 1 here); ACTIVE or unset (a standalone llama.cpp's
default) spins, reaching about 100-118 tok/s while the other core is free and dropping to 10-30 tok/s when another
process takes it. An OMP_WAIT_POLICY already in the environment is kept, so ``OMP_WAIT_POLICY=ACTIVE`` measures
both sides spinning.

Sections (``--only`` takes a comma-separated list of them):
  decode      One request alone: a 32-token prompt, 128 new tokens; best of 3 (2), a different prompt each time.
              ``*_decode_itl_ms`` is the mean time between tokens after the first (prefill excluded).
              ``decode_vs_llamacpp`` = ours on the GGUF (``ours_gguf_decode_tok_s``) / llama.cpp (target >= 1.5);
              ``gguf_decode_agree_tokens`` as ``decode_agree_tokens`` for that side.
              ``decode_agree_tokens``: how many leading tokens of the first run the two sides share. Q4_1 with
              8-bit activations against float32 diverges wherever two candidates are near-tied (for the chat
              question "What is the capital of France?" already at the first token: float32 puts "The" 0.08
              ahead of "L", llama.cpp the other way round), so it is a sanity check, not a score.
              ``ours_int8_decode_tok_s`` / ``vs_llamacpp_decode_int8``: ours with ``dtype: int8`` (4x fewer weight
              bytes than float32, still 2x llama.cpp's 4-bit) on the same requests.
              ``llamacpp_decode_completion_tok_s``: the same request through llama-cpp-python's high-level
              ``Llama.create_completion`` (its defaults: flash attention off), a check on the low-level driver.
  parallel32  32 requests at once, 128-token prompts, 128 new tokens (64). ``parallel32_vs_llamacpp`` = ours on
              the GGUF / llama.cpp (target >= 2.5).
  mixed       bench/engine.py's mixed workload: 64 requests (16) at once, prompts uniformly 64-512 tokens,
              max_tokens uniformly 16-256 (16-64), from the same seed.
  speculative Ours only: prompt-lookup speculative decoding (4 guesses a step) against plain decoding, batch 1,
              up to 128 tokens stopping at EOS, one prompt at a time, both sides interleaved, best of 3 (2).
              ``hit``: greedy "Summarize the following text" over three pages of the bundled handbook (the
              summary copies phrases); ``nocopy``: three short creative requests, greedy (nothing to copy from
              the prompt, though a small model's greedy text repeats itself, which prompt lookup also catches);
              ``miss``: the same requests sampled at temperature 1 with a fixed seed each, where guesses are
              mostly wrong: speculation's overhead. ``spec_speedup_{hit,nocopy,miss}`` = speculative tok/s /
              plain tok/s (both sides produce the same tokens: the section checks it);
              ``spec_*_acceptance_rate`` = accepted / proposed guesses.
  rss         Resident memory, each side in a fresh process (``--rss-child``) on the GGUF, room for 4,096 tokens
              of KV cache (one sequence), after serving one short request (every weight read once):
              ``*_runtime_rss_mb`` after the runtime's imports (torch, transformers with its GGUF converters and
              its Llama config module, the gguf package and our kernels; llama-cpp-python), ``*_rss_mb`` after
              the load, ``*_rss_load_mb`` the difference (weights, KV cache, tokenizer, buffers).
              ``rss_vs_llamacpp`` = ours / llama.cpp of what loading the model adds (target <= 1.2);
              ``rss_total_vs_llamacpp`` the same of the whole processes (torch's runtime is about 300 MB more
              than ggml's). ``ours_weights_mb``: ``LlamaModel.weight_bytes``. Both KV caches are float16 (dtype
              gguf's): 90 MB at 4,096 tokens.
  int8        Ours only: ``dtype: int8`` against float32 on the decode section's requests (interleaved, best of
              3 (2)): ``int8_decode_speedup``; ``int8_weight_memory_ratio`` = bytes of weights the forward reads,
              int8 / float32 (``LlamaModel.weight_bytes``); ``int8_greedy_agreement`` = share of output positions
              where int8's greedy token equals float32's (six chat prompts one at a time, 64 tokens each, EOS
              ignored; greedy text forks for good at the first near-tie), ``int8_greedy_first_divergence`` per
              prompt, and ``int8_next_token_agreement``: on float32's own outputs, the share of positions where
              int8's next token is float32's (teacher-forced, so one fork does not count for the rest).

Ours: ``LLMEngine.generate`` with every request of a section at once (float32, max_num_seqs 64,
max_num_batched_tokens 512, prefix caching on as deployed).

llama.cpp: driven through its C API (``llama_decode`` on a ``llama_batch`` holding many sequences) the way
llama-server serves parallel slots: each step packs every generating slot's next token first, then prompt
chunks of the slots still prefilling, up to n_batch = 512 tokens; a finished request frees its slot (and its KV
cells) for the next waiting one. Slots: 1 for decode, 32 for parallel32, ``--llamacpp-slots`` (64) for mixed.
One KV stream per slot (llama.cpp's default, ``kv_unified`` false: each sequence attends only to its own cells;
``--llamacpp-kv-unified`` switches to one shared buffer), flash attention as llama.cpp decides (auto),
n_ubatch 512. Greedy sampling is an argmax over each output row of logits; EOS is simply not a stop condition.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds http.py, which would shadow the standard library's http
# package (imported by torch, httpx...) for any script run from here.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import contextlib
import gc
import importlib.util
import json
import logging
import math
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from types import ModuleType
from typing import Any

import numpy as np

# Must precede the torch import (in main, so that --help stays quick): OpenMP reads it once, when it loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

log = logging.getLogger("bench.engine_speed")

BENCH_DIR = Path(__file__).resolve().parent
MODEL_DIR = "models/smollm2-135m-instruct"
GGUF_NAME = "model.gguf"
NUM_THREADS = 2
MAX_NUM_SEQS = 64
MAX_BATCHED_TOKENS = 512
LLAMACPP_N_BATCH = 512
DECODE_PROMPT_LEN = 32
DECODE_NEW_TOKENS = 128
PARALLEL_SEQS = 32
PARALLEL_PROMPT_LEN = 128
SPEC_NUM_PROMPTS = 3
SPEC_NEW_TOKENS = 128
SPEC_NUM_TOKENS = 4
NO_BUILD_NOTE = ("llama_cpp is not importable: run `make bench-deps` (it compiles llama-cpp-python, about 12 minutes "
                 "on 2 cores) to get the llama.cpp figures")


def workloads() -> ModuleType:
    """bench/engine.py as a module: its workload data (passage, mixed requests), so "mixed" is the same set."""
    return _bench_module("engine")


@cache
def _bench_module(stem: str) -> ModuleType:
    """bench/<stem>.py as a module. The bench folder is not a package, so the file is loaded by path; its
    ``__main__`` block does not run."""
    name = f"_bench_{stem}"
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True, slots=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Sizes:
    num_decode_repeats: int
    parallel_new_tokens: int
    quick: bool
    """Whether the mixed workload takes bench/engine.py's QUICK sizes rather than its FULL ones."""


FULL = Sizes(3, 128, quick=False)
QUICK = Sizes(2, 64, quick=True)


@dataclass(slots=True)
class Run:
    """One measured burst: output tokens, wall time, and per-request times (TTFT, end to end, outputs)."""

    num_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.num_tokens / self.wall_s

    @property
    def mean_ttft_s(self) -> float | None:
        return statistics.fmean(self.ttft_s) if self.ttft_s else None

    def itl_ms(self, i: int = 0) -> float | None:
        """Mean time between request ``i``'s tokens after its first."""
        n = len(self.outputs[i]) if self.outputs else 0
        return None if n < 2 else (self.e2e_s[i] - self.ttft_s[i]) / (n - 1) * 1e3


def _slice(pool: list[int], rng: random.Random, length: int) -> list[int]:
    start = rng.randrange(len(pool) - length)
    return pool[start : start + length]


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------- our engine


def load_engine(model_dir: str) -> Any:
    from serving.engine.config import EngineConfig
    from serving.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=model_dir, dtype="float32", num_threads=NUM_THREADS,
                                  max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED_TOKENS))


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
    return Run(sum(len(o.token_ids) for o in outs), wall_s, [o.ttft_s for o in outs], [o.e2e_s for o in outs],
               [list(o.token_ids) for o in outs])


# ---------------------------------------------------------------------------------------------- llama.cpp


class LlamaCpp:
    """The GGUF loaded once through llama.cpp's C API (llama-cpp-python's ctypes bindings)."""

    def __init__(self, gguf: Path, num_threads: int, kv_unified: bool = False) -> None:
        import llama_cpp

        # The bindings route llama.cpp's log lines to this logger's level; INFO would print every tensor.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self.lib = llama_cpp
        self.num_threads = num_threads
        self.kv_unified = kv_unified
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        buf = (llama_cpp.ctypes.c_char * 128)()
        llama_cpp.llama_model_desc(self.model, buf, len(buf))
        self.desc = f"{buf.value.decode()}, {llama_cpp.llama_model_n_params(self.model) / 1e6:.0f}M params"
        self.version = getattr(llama_cpp, "__version__", "?")
        flash_attn = llama_cpp.llama_context_default_params().flash_attn_type  # left as is by our sessions
        self.flash_attn = {-1: "auto", 0: "off", 1: "on"}.get(flash_attn, str(flash_attn))

    @contextlib.contextmanager
    def session(self, num_slots: int, slot_ctx: int) -> Iterator[LlamaSession]:
        """A context with ``num_slots`` sequences of up to ``slot_ctx`` tokens each; freed on exit."""
        session = LlamaSession(self, num_slots, slot_ctx)
        try:
            yield session
        finally:
            session.close()

    def close(self) -> None:
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None


class LlamaSession:
    """One llama_context plus a reusable llama_batch; ``decode`` runs one step and returns greedy tokens."""

    def __init__(self, llama: LlamaCpp, num_slots: int, slot_ctx: int) -> None:
        lib = self.lib = llama.lib
        self.n_vocab = llama.n_vocab
        self.num_slots = num_slots
        params = lib.llama_context_default_params()
        # llama.cpp rounds each sequence's share of the context; keep it a multiple of 256.
        params.n_ctx = num_slots * 256 * math.ceil(slot_ctx / 256)
        params.n_batch = params.n_ubatch = LLAMACPP_N_BATCH
        params.n_seq_max = num_slots
        params.n_threads = params.n_threads_batch = llama.num_threads
        params.kv_unified = llama.kv_unified
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(llama.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context ({num_slots} slots, n_ctx {params.n_ctx})")
        self.mem = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(LLAMACPP_N_BATCH, 0, 1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.mem, True)

    def release(self, seq_id: int) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq_id, -1, -1)

    def decode(self, items: Sequence[tuple[int, int, int, bool]]) -> list[int]:
        """One ``llama_decode`` of (token, position, sequence, wants logits) items; argmax of each logits row."""
        lib, batch = self.lib, self.batch
        for i, (token, pos, seq_id, logits) in enumerate(items):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = logits
        batch.n_tokens = len(items)
        rc = lib.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} on a batch of {len(items)} tokens")
        return [int(np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax())
                for i, item in enumerate(items) if item[3]]


@dataclass(slots=True)
class _Slot:
    index: int
    """Position of the request in the submitted list."""
    request: Request
    prefilled: int = 0
    outputs: list[int] = field(default_factory=list)


def llamacpp_run(session: LlamaSession, requests: Sequence[Request]) -> Run:
    """Serve ``requests`` on the session's slots like llama-server: generating slots first, then prompt chunks."""
    start = time.perf_counter()
    waiting = deque(enumerate(requests))
    free = list(range(session.num_slots - 1, -1, -1))
    active: dict[int, _Slot] = {}
    ttft_s, e2e_s = [0.0] * len(requests), [0.0] * len(requests)
    outputs: list[list[int]] = [[] for _ in requests]
    while waiting or active:
        while waiting and free:
            index, request = waiting.popleft()
            active[free.pop()] = _Slot(index, request)
        items: list[tuple[int, int, int, bool]] = []
        owners: list[int] = []  # the slot of each item that wants logits, in item order
        for seq_id, slot in active.items():
            if slot.outputs:
                items.append((slot.outputs[-1], len(slot.request.prompt_ids) + len(slot.outputs) - 1, seq_id, True))
                owners.append(seq_id)
        for seq_id, slot in active.items():
            prompt = slot.request.prompt_ids
            chunk = min(LLAMACPP_N_BATCH - len(items), len(prompt) - slot.prefilled)
            if slot.outputs or chunk <= 0:
                continue
            for pos in range(slot.prefilled, slot.prefilled + chunk):
                last = pos == len(prompt) - 1
                items.append((prompt[pos], pos, seq_id, last))
                if last:
                    owners.append(seq_id)
            slot.prefilled += chunk
        tokens = session.decode(items)
        now = time.perf_counter() - start
        for seq_id, token in zip(owners, tokens, strict=True):
            slot = active[seq_id]
            slot.outputs.append(token)
            if len(slot.outputs) == 1:
                ttft_s[slot.index] = now
            if len(slot.outputs) == slot.request.max_tokens:
                e2e_s[slot.index], outputs[slot.index] = now, slot.outputs
                session.release(seq_id)
                del active[seq_id]
                free.append(seq_id)
    wall_s = time.perf_counter() - start
    return Run(sum(map(len, outputs)), wall_s, ttft_s, e2e_s, outputs)


def llamacpp_completion_tok_s(gguf: Path, request: Request, repeats: int) -> float:
    """Best tok/s of ``Llama.create_completion`` on one request, EOS masked out by a logits processor."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=512, n_threads=NUM_THREADS, n_threads_batch=NUM_THREADS,
                          n_batch=LLAMACPP_N_BATCH, verbose=False)
    eos = llm.token_eos()

    def no_eos(input_ids: Any, scores: Any) -> Any:
        scores[eos] = -np.inf
        return scores

    try:
        best = 0.0
        for _ in range(repeats + 1):  # the first is a warm-up
            llm.reset()
            start = time.perf_counter()
            out = llm.create_completion(request.prompt_ids, max_tokens=request.max_tokens, temperature=0.0,
                                        logits_processor=llama_cpp.LogitsProcessorList([no_eos]))
            wall_s = time.perf_counter() - start
            got = out["usage"]["completion_tokens"]
            if got != request.max_tokens:
                raise RuntimeError(f"create_completion produced {got} tokens, {request.max_tokens} asked")
            best = max(best, got / wall_s)
        return best
    finally:
        llm.close()


# ---------------------------------------------------------------------------------------------- the bench


@dataclass(slots=True)
class Bench:
    """What every section needs; our engine and llama.cpp are loaded on first use and shared."""

    args: argparse.Namespace
    sizes: Sizes
    pool: list[int]
    notes: list[str] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)
    _engine: Any = None
    _gguf_engine: Any = None
    _llama: Any = None
    _llama_tried: bool = False

    @property
    def engine(self) -> Any:
        if self._engine is None:
            with self.timed("load/ours"):
                engine = load_engine(self.args.model)
                ours_run(engine, [Request(self.pool[:64], 8), Request(self.pool[64:96], 8)])  # warm-up
            self._engine = engine
        return self._engine

    @property
    def gguf_engine(self) -> Any:
        """Ours on the same GGUF file as llama.cpp, in its own blocks (``dtype: gguf``)."""
        if self._gguf_engine is None:
            with self.timed("load/ours_gguf"):
                engine = _engine_like(self, model=str(self.gguf), dtype="gguf")
                ours_run(engine, [Request(self.pool[:64], 8), Request(self.pool[64:96], 8)])  # warm-up
            self._gguf_engine = engine
        return self._gguf_engine

    @property
    def llama(self) -> LlamaCpp | None:
        """None when llama.cpp is not asked for or cannot run (with a note saying why)."""
        if not self.args.llamacpp or self._llama_tried:
            return self._llama
        self._llama_tried = True
        try:
            import llama_cpp  # noqa: F401
        except (ImportError, OSError, RuntimeError) as exc:  # not installed, or its shared library fails to load
            print(f"NOTE: {NO_BUILD_NOTE} ({exc})", file=sys.stderr, flush=True)
            self.notes.append(NO_BUILD_NOTE)
            return None
        gguf = self.gguf
        if not gguf.is_file():
            self.notes.append(f"llama.cpp: no GGUF at {gguf} (`make install` keeps it as {MODEL_DIR}/{GGUF_NAME})")
            return None
        with self.timed("load/llamacpp"):
            self._llama = LlamaCpp(gguf, NUM_THREADS, kv_unified=self.args.llamacpp_kv_unified)
        return self._llama

    @property
    def gguf(self) -> Path:
        return Path(self.args.gguf or Path(self.args.model) / GGUF_NAME)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        log.info("%s ...", name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings_s[name] = round(time.perf_counter() - start, 1)
            log.info("%s took %.1f s", name, self.timings_s[name])

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Timed; a failure becomes a note and leaves that part's figures null, and the bench goes on."""
        with self.timed(name):
            try:
                yield
            except Exception as exc:  # a benchmark reports what it could measure rather than stopping
                log.exception("%s failed", name)
                self.notes.append(f"{name}: {type(exc).__name__}: {exc}")


def llamacpp_burst(llama: LlamaCpp, requests: Sequence[Request], num_slots: int) -> Run:
    """A fresh context sized for ``requests``, warmed up with one short request, then the timed burst."""
    slot_ctx = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    with llama.session(num_slots, slot_ctx) as session:
        llamacpp_run(session, [Request(requests[0].prompt_ids[:16], 4)])
        session.clear()
        return llamacpp_run(session, requests)


def decode_section(b: Bench) -> dict[str, Any]:
    rng = random.Random(b.args.seed + 2)
    requests = [Request(_slice(b.pool, rng, DECODE_PROMPT_LEN), DECODE_NEW_TOKENS)
                for _ in range(b.sizes.num_decode_repeats)]
    f: dict[str, Any] = {}
    ours: list[Run] = []
    with b.part("decode/ours"):
        ours = [ours_run(b.engine, [r]) for r in requests]
        best = max(ours, key=lambda run: run.tok_s)
        f["ours_decode_tok_s"], f["ours_decode_itl_ms"] = best.tok_s, best.itl_ms()
    gguf: list[Run] = []
    with b.part("decode/ours_gguf"):
        gguf = [ours_run(b.gguf_engine, [r]) for r in requests]
        best = max(gguf, key=lambda run: run.tok_s)
        f["ours_gguf_decode_tok_s"], f["ours_gguf_decode_itl_ms"] = best.tok_s, best.itl_ms()
    with b.part("decode/ours_int8"):
        int8 = _engine_like(b, dtype="int8")
        ours_run(int8, [Request(b.pool[:64], 8)])  # warm-up
        f["ours_int8_decode_tok_s"] = max(ours_run(int8, [r]).tok_s for r in requests)
        del int8
        gc.collect()
    if b.llama is not None:
        with b.part("decode/llamacpp"):
            slot_ctx = DECODE_PROMPT_LEN + DECODE_NEW_TOKENS
            with b.llama.session(1, slot_ctx) as session:
                llamacpp_run(session, [Request(requests[0].prompt_ids[:16], 4)])  # warm-up
                runs = []
                for request in requests:
                    session.clear()
                    runs.append(llamacpp_run(session, [request]))
            best = max(runs, key=lambda run: run.tok_s)
            f["llamacpp_decode_tok_s"], f["llamacpp_decode_itl_ms"] = best.tok_s, best.itl_ms()
            if ours:
                a, c = ours[0].outputs[0], runs[0].outputs[0]
                f["decode_agree_tokens"] = next((i for i, (x, y) in enumerate(zip(a, c, strict=True)) if x != y),
                                                len(a))
            if gguf:
                a = gguf[0].outputs[0]
                f["gguf_decode_agree_tokens"] = next(
                    (i for i, (x, y) in enumerate(zip(a, c, strict=True)) if x != y), len(a))
        with b.part("decode/llamacpp_completion"):
            f["llamacpp_decode_completion_tok_s"] = llamacpp_completion_tok_s(b.gguf, requests[0],
                                                                              b.sizes.num_decode_repeats)
    f["decode_vs_llamacpp"] = _ratio(f.get("ours_gguf_decode_tok_s"), f.get("llamacpp_decode_tok_s"))
    f["vs_llamacpp_decode"] = _ratio(f.get("ours_decode_tok_s"), f.get("llamacpp_decode_tok_s"))
    f["vs_llamacpp_decode_int8"] = _ratio(f.get("ours_int8_decode_tok_s"), f.get("llamacpp_decode_tok_s"))
    return f


def parallel32_section(b: Bench) -> dict[str, Any]:
    rng = random.Random(b.args.seed + 1)
    requests = [Request(_slice(b.pool, rng, PARALLEL_PROMPT_LEN), b.sizes.parallel_new_tokens)
                for _ in range(PARALLEL_SEQS)]
    f: dict[str, Any] = {}
    with b.part("parallel32/ours"):
        run = ours_run(b.engine, requests)
        f["ours_parallel32_tok_s"], f["ours_parallel32_mean_ttft_s"] = run.tok_s, run.mean_ttft_s
    with b.part("parallel32/ours_gguf"):
        run = ours_run(b.gguf_engine, requests)
        f["ours_gguf_parallel32_tok_s"], f["ours_gguf_parallel32_mean_ttft_s"] = run.tok_s, run.mean_ttft_s
    if b.llama is not None:
        with b.part("parallel32/llamacpp"):
            run = llamacpp_burst(b.llama, requests, PARALLEL_SEQS)
            f["llamacpp_parallel32_tok_s"], f["llamacpp_parallel32_mean_ttft_s"] = run.tok_s, run.mean_ttft_s
    f["parallel32_vs_llamacpp"] = _ratio(f.get("ours_gguf_parallel32_tok_s"), f.get("llamacpp_parallel32_tok_s"))
    f["vs_llamacpp_parallel32"] = _ratio(f.get("ours_parallel32_tok_s"), f.get("llamacpp_parallel32_tok_s"))
    return f


def mixed_section(b: Bench) -> dict[str, Any]:
    w = workloads()
    requests = w.mixed_requests(b.pool, w.QUICK if b.sizes.quick else w.FULL, random.Random(b.args.seed))
    f: dict[str, Any] = {"mixed_num_requests": len(requests)}
    with b.part("mixed/ours"):
        run = ours_run(b.engine, requests)
        f["ours_mixed_tok_s"], f["ours_mixed_mean_ttft_s"] = run.tok_s, run.mean_ttft_s
    if b.llama is not None:
        with b.part("mixed/llamacpp"):
            slots = min(b.args.llamacpp_slots, len(requests))
            run = llamacpp_burst(b.llama, requests, slots)
            f["llamacpp_mixed_tok_s"], f["llamacpp_mixed_mean_ttft_s"] = run.tok_s, run.mean_ttft_s
            f["llamacpp_mixed_slots"] = slots
    f["vs_llamacpp_mixed"] = _ratio(f.get("ours_mixed_tok_s"), f.get("llamacpp_mixed_tok_s"))
    return f


def _engine_like(b: Bench, **options: Any) -> Any:
    """Another engine with *options* changed: on the shared engine's weights, or loaded again for another dtype
    (int8 quantizes at load)."""
    from dataclasses import replace

    from serving.engine.engine import LLMEngine
    from serving.engine.models import LoadedModel

    base = b.engine
    config = replace(base.config, **options)
    if config.dtype != base.config.dtype:
        return LLMEngine(config)
    return LLMEngine(config, loaded=LoadedModel(base.model, base.hf_config, base.tokenizer))


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_dict=False)
    return list(ids)


def spec_prompts(tokenizer: Any) -> tuple[list[list[int]], list[list[int]]]:
    """(hit, miss) chat prompts. Hit: summarise a page of the bundled handbook (the answer copies phrases
    from it); miss: short creative requests with nothing to copy from."""
    pages = sorted((Path(__file__).resolve().parents[1] / "pipelines" / "data" / "handbook").glob("*.md"))
    hit = [_chat_ids(tokenizer, "Summarize the following text.\n\n" + page.read_text()[:2500])
           for page in pages[:SPEC_NUM_PROMPTS]]
    miss = [_chat_ids(tokenizer, topic) for topic in (
        "Write a short story about a dragon who learns to bake bread.",
        "Invent a new board game and describe how a turn works.",
        "Write a limerick about a forgetful robot.")[:SPEC_NUM_PROMPTS]]
    return hit, miss


def _batch1_tok_s(engine: Any, prompts: list[list[int]], temperature: float) -> tuple[float, list[list[int]]]:
    """One prompt at a time (batch 1), stopping at EOS: total output tokens / total seconds.

    Greedy, or sampled with a fixed seed per prompt (speculation then gives the very same tokens).
    """
    from serving.engine.sampling_params import SamplingParams

    tokens, seconds, outputs = 0, 0.0, []
    for seed, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=SPEC_NEW_TOKENS, temperature=temperature, seed=seed)
        start = time.perf_counter()
        out = engine.generate([prompt], params)[0]
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
        outputs.append(list(out.token_ids))
    return tokens / seconds, outputs


def speculative_section(b: Bench) -> dict[str, Any]:
    """Prompt lookup against plain decoding at batch 1, each side best of the repeats, interleaved."""
    f: dict[str, Any] = {}
    with b.part("speculative"):
        hit, miss = spec_prompts(b.engine.tokenizer)
        spec = _engine_like(b, speculative="ngram", num_speculative_tokens=SPEC_NUM_TOKENS)
        for name, prompts, temperature in (("hit", hit, 0.0), ("nocopy", miss, 0.0), ("miss", miss, 1.0)):
            plain_runs, spec_runs = [], []
            for _ in range(b.sizes.num_decode_repeats):
                plain_runs.append(_batch1_tok_s(b.engine, prompts, temperature))
                before = spec.metrics.snapshot()
                spec_runs.append(_batch1_tok_s(spec, prompts, temperature))
                after = spec.metrics.snapshot()
            if any(s[1] != p[1] for s, p in zip(spec_runs, plain_runs, strict=True)):
                raise RuntimeError(f"speculative output differs from plain decoding on the {name} prompts")
            proposed = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
            accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            f[f"plain_{name}_tok_s"] = max(r[0] for r in plain_runs)
            f[f"spec_{name}_tok_s"] = max(r[0] for r in spec_runs)
            f[f"spec_speedup_{name}"] = _ratio(f[f"spec_{name}_tok_s"], f[f"plain_{name}_tok_s"])
            f[f"spec_{name}_proposed"], f[f"spec_{name}_accepted"] = proposed, accepted
            f[f"spec_{name}_acceptance_rate"] = _ratio(accepted, proposed) or 0.0
    return f


def int8_section(b: Bench) -> dict[str, Any]:
    """dtype int8 against float32: batch-1 decode, weight memory, greedy agreement; the same requests as decode."""
    from serving.engine.sampling_params import SamplingParams

    rng = random.Random(b.args.seed + 2)
    requests = [Request(_slice(b.pool, rng, DECODE_PROMPT_LEN), DECODE_NEW_TOKENS)
                for _ in range(b.sizes.num_decode_repeats)]
    f: dict[str, Any] = {}
    with b.part("int8"):
        int8 = _engine_like(b, dtype="int8")
        ours_run(int8, [Request(b.pool[:64], 8)])  # warm-up
        plain, quant = [], []
        for request in requests:  # interleaved, so a noisy neighbour hits both sides alike
            plain.append(ours_run(b.engine, [request]).tok_s)
            quant.append(ours_run(int8, [request]).tok_s)
        f["float32_decode_tok_s"], f["int8_decode_tok_s"] = max(plain), max(quant)
        f["int8_decode_speedup"] = _ratio(max(quant), max(plain))
        f["float32_weight_bytes"], f["int8_weight_bytes"] = b.engine.model.weight_bytes(), int8.model.weight_bytes()
        f["int8_weight_memory_ratio"] = _ratio(f["int8_weight_bytes"], f["float32_weight_bytes"])
        hit, miss = spec_prompts(b.engine.tokenizer)
        prompts = hit + miss
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        # One prompt at a time: batched int8 rows may differ from a lone row in the last bits (quant.py).
        reference = [b.engine.generate([p], params)[0].token_ids for p in prompts]
        ours = [int8.generate([p], params)[0].token_ids for p in prompts]
        same = sum(x == y for r, o in zip(reference, ours, strict=True) for x, y in zip(r, o, strict=True))
        f["int8_greedy_agreement"] = same / sum(len(r) for r in reference)
        f["int8_greedy_first_divergence"] = [
            next((i for i, (x, y) in enumerate(zip(r, o, strict=True)) if x != y), len(r))
            for r, o in zip(reference, ours, strict=True)]
        # Teacher-forced: on float32's own text, how often int8's next token is float32's.
        quality = _bench_module("quality")
        agree = total = 0
        for prompt, out in zip(prompts, reference, strict=True):
            text = list(prompt) + list(out)
            picks = [quality.next_token_logits(m.model, text)[len(prompt) - 1:].argmax(-1) for m in (b.engine, int8)]
            agree += int((picks[0] == picks[1]).sum())
            total += len(out)
        f["int8_next_token_agreement"] = agree / total
        del int8
        gc.collect()
    return f


RSS_CONTEXT_TOKENS = 4096


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def rss_child(side: str, gguf: Path) -> dict[str, float]:
    """In a fresh process: resident memory after the runtime's imports, and after loading *gguf* with room for
    RSS_CONTEXT_TOKENS tokens of KV cache and serving one short request (every weight read once)."""
    prompt = list(range(1000, 1032))
    if side == "ours":
        import torch

        from serving.engine.config import EngineConfig
        from serving.engine.engine import LLMEngine
        from serving.engine.kernels import cpu_ops

        # The runtime, loaded before the baseline: the kernels' shared library and the code that reads a GGUF
        # file (transformers' GGUF config and tokenizer converters, the gguf package), as llama.cpp's are in
        # its library.
        for module in ("gguf.quants", "transformers.integrations.ggml", "transformers.modeling_gguf_pytorch_utils",
                       "transformers.models.llama.configuration_llama"):  # the last alone is about 55 MB of code
            importlib.import_module(module)

        torch.set_num_threads(NUM_THREADS)
        cpu_ops()
        before = _rss_mb()
        config = EngineConfig(model=str(gguf), dtype="gguf", num_threads=NUM_THREADS, max_num_seqs=1)
        config.num_blocks = RSS_CONTEXT_TOKENS // config.block_size  # a KV cache of RSS_CONTEXT_TOKENS tokens
        engine = LLMEngine(config)
        ours_run(engine, [Request(prompt, 8)])
        weights = engine.model.weight_bytes() / 2**20
    else:
        import llama_cpp  # noqa: F401

        before = _rss_mb()
        llama = LlamaCpp(gguf, NUM_THREADS)
        with llama.session(1, RSS_CONTEXT_TOKENS) as session:
            llamacpp_run(session, [Request(prompt, 8)])
            return {"before_mb": before, "after_mb": _rss_mb(), "weights_mb": None}
    return {"before_mb": before, "after_mb": _rss_mb(), "weights_mb": weights}


def _rss_of(side: str, gguf: Path) -> dict[str, float]:
    import subprocess

    done = subprocess.run([sys.executable, __file__, "--rss-child", side, "--gguf", str(gguf)], capture_output=True,
                          text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {side} memory probe failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rss_section(b: Bench) -> dict[str, Any]:
    """Resident memory after load, each side in a fresh process on the same GGUF and context size."""
    f: dict[str, Any] = {"rss_context_tokens": RSS_CONTEXT_TOKENS}
    with b.part("rss/ours"):
        ours = _rss_of("ours", b.gguf)
        f["ours_rss_mb"], f["ours_rss_load_mb"] = ours["after_mb"], ours["after_mb"] - ours["before_mb"]
        f["ours_runtime_rss_mb"], f["ours_weights_mb"] = ours["before_mb"], ours["weights_mb"]
    if b.args.llamacpp and importlib.util.find_spec("llama_cpp") is not None:
        with b.part("rss/llamacpp"):
            theirs = _rss_of("llamacpp", b.gguf)
            f["llamacpp_rss_mb"] = theirs["after_mb"]
            f["llamacpp_rss_load_mb"] = theirs["after_mb"] - theirs["before_mb"]
            f["llamacpp_runtime_rss_mb"] = theirs["before_mb"]
    f["rss_vs_llamacpp"] = _ratio(f.get("ours_rss_load_mb"), f.get("llamacpp_rss_load_mb"))
    f["rss_total_vs_llamacpp"] = _ratio(f.get("ours_rss_mb"), f.get("llamacpp_rss_mb"))
    return f


@dataclass(frozen=True, slots=True)
class Section:
    """A named part of the bench: ``run`` returns figures merged into the result; ``keys`` are always present."""

    name: str
    run: Callable[[Bench], dict[str, Any]]
    keys: tuple[str, ...]


SECTIONS: tuple[Section, ...] = (
    Section("decode", decode_section, (
        "decode_vs_llamacpp", "ours_gguf_decode_tok_s", "ours_gguf_decode_itl_ms", "gguf_decode_agree_tokens",
        "ours_decode_tok_s", "llamacpp_decode_tok_s", "vs_llamacpp_decode", "ours_int8_decode_tok_s",
        "vs_llamacpp_decode_int8", "ours_decode_itl_ms",
        "llamacpp_decode_itl_ms", "decode_agree_tokens", "llamacpp_decode_completion_tok_s")),
    Section("parallel32", parallel32_section, (
        "parallel32_vs_llamacpp", "ours_gguf_parallel32_tok_s", "ours_gguf_parallel32_mean_ttft_s",
        "ours_parallel32_tok_s", "llamacpp_parallel32_tok_s", "vs_llamacpp_parallel32",
        "ours_parallel32_mean_ttft_s", "llamacpp_parallel32_mean_ttft_s")),
    Section("mixed", mixed_section, (
        "ours_mixed_tok_s", "llamacpp_mixed_tok_s", "vs_llamacpp_mixed", "ours_mixed_mean_ttft_s",
        "llamacpp_mixed_mean_ttft_s")),
    Section("speculative", speculative_section, (
        "spec_speedup_hit", "spec_speedup_miss", "spec_speedup_nocopy", "spec_hit_acceptance_rate",
        "spec_miss_acceptance_rate", "spec_nocopy_acceptance_rate", "plain_hit_tok_s", "spec_hit_tok_s",
        "plain_miss_tok_s", "spec_miss_tok_s")),
    Section("rss", rss_section, (
        "rss_vs_llamacpp", "rss_total_vs_llamacpp", "ours_rss_mb", "llamacpp_rss_mb", "ours_rss_load_mb",
        "llamacpp_rss_load_mb", "ours_runtime_rss_mb", "llamacpp_runtime_rss_mb", "ours_weights_mb",
        "rss_context_tokens")),
    Section("int8", int8_section, (
        "int8_decode_speedup", "int8_weight_memory_ratio", "int8_greedy_agreement", "int8_next_token_agreement",
        "float32_decode_tok_s", "int8_decode_tok_s")),
)


def _sections(spec: str | None) -> list[Section]:
    if not spec:
        return list(SECTIONS)
    by_name = {s.name: s for s in SECTIONS}
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"error: unknown section(s) {unknown}; choose from {list(by_name)}")
    return [by_name[n] for n in names]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Sections and figures: see the module docstring (bench/engine_speed.py).")
    parser.add_argument("--llamacpp", action="store_true",
                        help="also run llama.cpp (needs the bench extra: make bench-deps)")
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--only", metavar="SECTIONS",
                        help=f"comma-separated sections to run (default: all of {[s.name for s in SECTIONS]})")
    parser.add_argument("--model", default=MODEL_DIR, help=f"our engine's HF model folder (default: {MODEL_DIR})")
    parser.add_argument("--gguf", help=f"llama.cpp's model file (default: MODEL/{GGUF_NAME})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workloads' prompts and lengths")
    parser.add_argument("--llamacpp-slots", type=int, default=MAX_NUM_SEQS,
                        help="llama.cpp's parallel sequences for the mixed workload (default: %(default)s)")
    parser.add_argument("--llamacpp-kv-unified", action="store_true",
                        help="llama.cpp: one KV buffer shared by all sequences instead of one stream per sequence")
    parser.add_argument("--rss-child", choices=("ours", "llamacpp"), help=argparse.SUPPRESS)  # the rss section's probe
    args = parser.parse_args(argv)
    if args.rss_child:
        return rss_child(args.rss_child, Path(args.gguf or Path(args.model) / GGUF_NAME))
    if not 1 <= args.llamacpp_slots <= 256:  # llama.cpp's LLAMA_MAX_SEQ
        parser.error("--llamacpp-slots must be in [1, 256]")
    sections = _sections(args.only)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(NUM_THREADS)
    started = time.perf_counter()
    sizes = QUICK if args.quick else FULL
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    b = Bench(args, sizes, workloads().text_pool(tokenizer, 4096))
    figures: dict[str, Any] = {key: None for s in sections for key in s.keys}
    with b.part("load"):  # loaded here so that section timings leave loading out; else on first use
        _ = b.engine, b.llama
    for section in sections:
        with b.part(section.name):
            result = section.run(b)
            figures.update(result)
            print(f"\n== {section.name} ==", flush=True)
            for key, value in result.items():
                print(f"  {key:<40} {_fmt(value)}", flush=True)
        gc.collect()
    llama = b._llama
    if llama is not None:
        llama.close()
    b.timings_s["total"] = round(time.perf_counter() - started, 1)
    return {**figures, "quick": args.quick, "sections": [s.name for s in sections], "threads": NUM_THREADS,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "llamacpp_version": llama.version if llama else None, "llamacpp_model": llama.desc if llama else None,
            "llamacpp_kv_unified": args.llamacpp_kv_unified if llama else None,
            "llamacpp_flash_attn": llama.flash_attn if llama else None,
            "timings_s": b.timings_s, "notes": b.notes}


if __name__ == "__main__":
    result = main()
    print(json.dumps({k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in result.items()}), flush=True)
