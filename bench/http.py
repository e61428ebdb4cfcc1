"""Serving overhead: the chat pipeline over HTTP against the same engine called in-process, in one run.

    .venv/bin/python bench/http.py [--quick] [--clients N] [--max-tokens N] [--repeats R] [--sequential S]
                                   [--config FILE]

Both sides get the same N (32; 8 with --quick) questions at once, greedy, with the same max_tokens (64; 16).
  direct  an in-process ``AsyncEngine`` built from the config's first model exactly as ``inferline serve``
          builds it (``engine_config``, same KV and batching options). Prompts are the chat pipeline's own
          messages (its ``prompt`` stage templates rendered for each question) through the tokenizer's chat
          template, so prompt tokens match what the ``tokenize`` stage sends (checked: ``prompt_tokens_match``).
  http    ``inferline serve`` as a subprocess on a free loopback port (ready when ``GET /readyz`` is 200),
          and N concurrent ``POST /pipelines/chat`` requests, ``"stream": true``, each on its own keep-alive
          connection, read as Server-Sent Events up to its ``done`` event. The client is a lean one
          (``Connection``, asyncio streams), not httpx: with httpx a burst's requests reached the server
          20-24 ms after the client began them, 2-5 ms with this one, time the server never saw.
The HTTP pipeline cannot set ``ignore_eos``, so neither side does: both run the same greedy work and a request
may stop before max_tokens. Throughput counts the output tokens each side actually produced (direct: the last
event's ``num_output_tokens``; http: ``usage.output_tokens`` of ``done``) over the wall time from the first
submit to the last answer. One untimed warm-up round per side (same prompts, 4 tokens) loads the kernels, fills
both prefix caches identically and uses the client's keep-alive connections (TCP connect is not timed); on the
http side it also fills the tokenizer's piece cache (serving/backends/piece_cache.py), so ``tokenize`` encodes
no new text
(about 40 us a request less than a new question takes in the server). Then
the sides run R (3) times interleaved, direct, http, direct, http, ...; throughput is each side's best round
(highest tok/s), because this machine is noisy, and the per-request figures (added, TTFT, e2e, stages) are
over the requests of every round: one burst's median moves by several ms from burst to burst (14-20 ms over
servers of the same code). The client shares the CPUs with the server, as a local client would.

Figures (the last line of stdout is one JSON object with them all):
  http_vs_direct   http tok/s / direct tok/s (target >= 0.9).
  added_ms_p50/95  per request, over every http round: client end-to-end time (request sent to ``done``
                   received) minus model time. Model time is the sum of the ``generate`` and ``stream`` stage
                   durations that the server reports in ``done``: from submitting the prompt to the engine to
                   the last token detokenized and queued for the client, the same span a direct caller waits
                   for (plus detokenizing). Not ``duration_ms`` minus the other stages: the runner's own
                   bookkeeping between stages is serving overhead too. So "added" is everything serving puts
                   around the model: HTTP and body parsing, validation, auth, the runner, the stages before
                   the model (``prompt``, ``tokenize``) and after it (``audit``, if the pipeline has one), SSE
                   framing and delivery of the final event, and the client reading it.
                   Per-token costs inside ``stream`` (detokenizing, deltas waiting for a busy event loop) are not
                   in it; they show in http_vs_direct instead. Target p50 <= 5 ms. With N requests arriving
                   at once this includes queueing: each waits for the server to parse and set up the ones ahead
                   of it, on CPUs the engine is already using for the first arrivals.
  added_ms_p50_rounds  each round's own median, to show the spread.
  added_ms_p50_sequential  the same for S (4) requests sent one at a time after the rounds (8 tokens each):
                   the fixed cost per request, without the queueing.
  server_other_ms_p50  of those, the part inside the runner: the other stages and the runner between them
                   (``duration_ms`` - model time);
  transport_ms_p50 and the part outside it (end-to-end - ``duration_ms``): HTTP, validation, auth, SSE, client.
  stage_ms_p50     each stage's own duration, by stage id.
  *_ttft_ms_p50    time to the first token: direct from submit to the first token event, http from sending
                   the request to the first ``delta`` event (``server_ttft_ms_p50``: the ``done`` event's own).
  server_exit_code the server's exit status after SIGTERM (0 expected).
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
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Must precede the torch import: OpenMP reads it once, when it loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# This file is named http.py; run as a script, its folder comes first on sys.path and would shadow the
# standard library's ``http`` package that httpx imports.
if sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    sys.path.pop(0)

import httpx
from prometheus_client import CollectorRegistry

from serving.backends.engine_config import engine_config
from serving.engine.async_engine import AsyncEngine
from serving.engine.sampling_params import SamplingParams
from serving.runtime.workspace import Workspace, open_workspace

PIPELINE = "chat"
MODEL_STAGE_TYPES = frozenset({"generate", "stream"})
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
WARMUP_TOKENS = 4
SEQUENTIAL_TOKENS = 8
QUESTIONS = (
    "What is the capital of France?", "Why is the sky blue?", "How do vaccines work?",
    "What is photosynthesis?", "Explain gravity to a child.", "What causes the seasons?",
    "How does a rainbow form?", "What is a black hole?", "Why do cats purr?", "How do bees make honey?",
    "What is the speed of light?", "Who wrote Romeo and Juliet?", "What is an atom?", "How do planes fly?",
    "What is machine learning?", "Why is the ocean salty?", "How does the heart pump blood?",
    "What is democracy?", "How are mountains formed?", "What is the water cycle?", "Why do leaves change color?",
    "What is a prime number?", "How does the internet work?", "What is climate change?",
    "How do magnets work?", "What is DNA?", "Why do we dream?", "How do volcanoes erupt?",
    "What is inflation?", "How does a compass work?", "What are the planets of the solar system?",
    "How do fish breathe underwater?",
)


@dataclass(slots=True)
class Sample:
    """One request as its caller saw it."""

    e2e_s: float
    ttft_s: float | None
    num_output_tokens: int
    num_prompt_tokens: int
    model_s: float | None = None
    """Server-side generate + stream stage time (http only)."""
    server_s: float | None = None
    """The server's whole-request ``duration_ms`` (http only)."""
    server_ttft_s: float | None = None
    stage_s: dict[str, float] = field(default_factory=dict)
    """Each server stage's duration by stage id (http only)."""


@dataclass(slots=True)
class Round:
    """One round of requests (a concurrent burst, or the sequential ones) and its wall time."""

    wall_s: float
    samples: list[Sample] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.samples)

    @property
    def tok_s(self) -> float:
        return self.num_output_tokens / self.wall_s


# -- prompts -------------------------------------------------------------------


def chat_messages(workspace: Workspace, questions: Sequence[str]) -> list[list[dict[str, str]]]:
    """The messages the pipeline's ``prompt`` stage builds for each question."""
    loaded = workspace.load_pipeline(workspace.resolve(PIPELINE))
    plan = next((p for p in loaded.plans if p.spec.type == "prompt"), None)
    if plan is None:
        raise SystemExit(f"{loaded.file}: no prompt stage; this bench expects the chat pipeline's shape")
    templates: dict[str, Any] = plan.config.templates  # type: ignore[attr-defined]
    unknown = set().union(*(t.names for t in templates.values())) - {"input"}
    if unknown:
        raise SystemExit(f"{loaded.file}: the prompt stage reads {sorted(unknown)}; this bench gives only input")
    return [[{"role": role, "content": t.render({"input": q}).strip()} for role, t in templates.items()]
            for q in questions]


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # Newer transformers return a BatchEncoding (a mapping), older ones a plain list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def questions_for(num_clients: int) -> list[str]:
    return [QUESTIONS[i % len(QUESTIONS)] for i in range(num_clients)]


# -- direct --------------------------------------------------------------------


async def start_engine(workspace: Workspace) -> AsyncEngine:
    """The config's first model, with the options ``inferline serve`` would give it."""
    name, spec = next(iter(workspace.server.models.items()))
    engine = AsyncEngine(engine_config(spec, workspace.root), name=name, metrics_registry=CollectorRegistry())
    await engine.start()
    return engine


async def direct_one(engine: AsyncEngine, prompt_ids: list[int], sampling: SamplingParams) -> Sample:
    started = time.perf_counter()
    stream = await engine.submit(prompt_ids, sampling)
    ttft_s, num_output_tokens = None, 0
    async for event in stream:
        if ttft_s is None:
            ttft_s = time.perf_counter() - started
        num_output_tokens = event.num_output_tokens
    return Sample(time.perf_counter() - started, ttft_s, num_output_tokens, len(prompt_ids))


async def direct_round(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int) -> Round:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    started = time.perf_counter()
    samples = await asyncio.gather(*(direct_one(engine, ids, sampling) for ids in prompts))
    return Round(time.perf_counter() - started, list(samples))


# -- http ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(config: str, port: int, log: Any) -> subprocess.Popen[bytes]:
    script = Path(sys.executable).with_name("inferline")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "serving.cli.main"]
    command += ["serve", "--config", config, "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


async def wait_ready(client: httpx.AsyncClient, server: subprocess.Popen[bytes], log_path: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}; its log: {log_path}")
        try:
            if (await client.get("/readyz")).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        await asyncio.sleep(0.2)
    raise SystemExit(f"the server was not ready after {READY_TIMEOUT_S:.0f} s; its log: {log_path}")


def done_sample(payload: str, started: float, ttft_s: float | None) -> Sample:
    """A sample from the ``done`` event's JSON, received now."""
    e2e_s = time.perf_counter() - started
    done = json.loads(payload)
    model_ms = sum(s["duration_ms"] for s in done["stages"] if s["type"] in MODEL_STAGE_TYPES)
    usage = done["usage"]
    server_ttft_s = None if done["ttft_ms"] is None else done["ttft_ms"] / 1e3
    return Sample(e2e_s, ttft_s, usage["output_tokens"], usage["input_tokens"], model_ms / 1e3,
                  done["duration_ms"] / 1e3, server_ttft_s, {s["id"]: s["duration_ms"] / 1e3 for s in done["stages"]})


class Connection:
    """One keep-alive HTTP/1.1 connection to the server, for streamed pipeline requests.

    A few lines over asyncio streams rather than httpx. Stamped on arrival at the server's ASGI app,
    a burst of 32 httpx requests got there 20-24 ms after the client began them (even the first), on
    the CPUs the server uses, and that delay counted as the server's; with this client, 2-5 ms. A
    request is one pre-encoded write, and the answer is read chunk by chunk until its end, as a
    load generator (wrk, k6) does.
    """

    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def ready(self) -> Connection:
        """Connected: the server closes a connection idle for 5 s (uvicorn's keep-alive), as during a
        direct round; it is opened again here, before the timing starts."""
        if self.reader is None or self.reader.at_eof():
            self.close()
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    @staticmethod
    def request(question: str, max_tokens: int) -> bytes:
        body = json.dumps({"input": question, "stream": True, "max_tokens": max_tokens}).encode()
        return (f"POST /pipelines/{PIPELINE} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body

    async def stream(self, request: bytes) -> AsyncIterator[bytes]:
        """Send *request*; yield the body of a 200 answer as it comes (chunked transfer encoding)."""
        assert self.reader is not None and self.writer is not None, "not connected: await ready() first"
        self.writer.write(request)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status, headers = head.split("\r\n", 1)
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in headers.split("\r\n"))}
        if "content-length" in fields:  # a problem-details answer, not a stream
            body = await self.reader.readexactly(int(fields["content-length"]))
            raise RuntimeError(f"POST /pipelines/{PIPELINE}: {status} {body!r}")
        if fields.get("transfer-encoding") != "chunked" or " 200 " not in status + " ":
            raise RuntimeError(f"POST /pipelines/{PIPELINE}: {status} {fields}")
        while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
            yield (await self.reader.readexactly(size + 2))[:-2]
        await self.reader.readuntil(b"\r\n")  # the empty trailer


async def http_one(conn: Connection, question: str, max_tokens: int) -> Sample:
    request = Connection.request(question, max_tokens)
    started = time.perf_counter()
    ttft_s, buffer, sample = None, b"", None
    async for chunk in conn.stream(request):  # read to the end of the answer: the connection is reused
        buffer += chunk
        *events, buffer = buffer.split(b"\r\n\r\n")
        for raw in events:
            name, _, data = raw.partition(b"\r\n")
            if name == b"event: delta" and ttft_s is None:
                ttft_s = time.perf_counter() - started
            elif name == b"event: done":  # timed as it arrives
                sample = done_sample(data.removeprefix(b"data: ").decode(), started, ttft_s)
            elif name == b"event: error":
                raise RuntimeError(f"the pipeline failed: {data.decode()}")
    if sample is None:
        raise RuntimeError("the event stream ended without a done event")
    return sample


async def http_round(conns: list[Connection], questions: list[str], max_tokens: int) -> Round:
    for conn in conns:
        await conn.ready()
    started = time.perf_counter()
    samples = await asyncio.gather(*(http_one(c, q, max_tokens) for c, q in zip(conns, questions, strict=True)))
    return Round(time.perf_counter() - started, list(samples))


async def http_sequential(conn: Connection, questions: list[str], max_tokens: int) -> Round:
    """One request at a time: the added latency without a burst queueing in front of it."""
    await conn.ready()
    started = time.perf_counter()
    samples = [await http_one(conn, q, max_tokens) for q in questions]
    return Round(time.perf_counter() - started, samples)


def stop_server(server: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM, then the exit code (None if it had to be killed)."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        return server.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        return None


# -- the run -------------------------------------------------------------------


async def measure(engine: AsyncEngine, conns: list[Connection], prompts: list[list[int]],
                  questions: list[str], args: argparse.Namespace) -> tuple[list[Round], list[Round], Round]:
    """Warm both sides up, interleave their rounds, then a few requests one at a time."""
    await direct_round(engine, prompts, WARMUP_TOKENS)
    await http_round(conns, questions, WARMUP_TOKENS)
    direct, http = [], []
    for repeat in range(1, args.repeats + 1):
        direct.append(await direct_round(engine, prompts, args.max_tokens))
        http.append(await http_round(conns, questions, args.max_tokens))
        print(f"round {repeat}: direct {direct[-1].tok_s:7.1f} tok/s ({direct[-1].num_output_tokens} tokens, "
              f"{direct[-1].wall_s:.2f} s)   http {http[-1].tok_s:7.1f} tok/s ({http[-1].num_output_tokens} "
              f"tokens, {http[-1].wall_s:.2f} s)", flush=True)
    sequential = await http_sequential(conns[0], questions[:args.sequential], SEQUENTIAL_TOKENS)
    return direct, http, sequential


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workspace = open_workspace(args.config)
    questions = questions_for(args.clients)
    messages = chat_messages(workspace, questions)
    port = free_port()
    with tempfile.NamedTemporaryFile("wb", prefix="inferline-serve-", suffix=".log", delete=False) as log:
        server = start_server(args.config, port, log)
    try:
        engine = await start_engine(workspace)  # loads while the server loads its own
        try:
            prompts = [encode_chat(engine.tokenizer, m) for m in messages]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False) as client:
                await wait_ready(client, server, log.name)
            conns = [Connection(port) for _ in questions]  # each round connects before it is timed
            try:
                rounds = await measure(engine, conns, prompts, questions, args)
            finally:
                for conn in conns:
                    conn.close()
        finally:
            await engine.shutdown()
    finally:
        exit_code = stop_server(server)
    print(f"server log: {log.name}", file=sys.stderr)
    return summary(*rounds, exit_code, args)


# -- the report ----------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def p50_ms(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(percentile(present, 50) * 1e3, 2) if present else None


def added_ms(samples: Sequence[Sample]) -> list[float]:
    return [(s.e2e_s - (s.model_s or 0.0)) * 1e3 for s in samples]


def summary(direct_rounds: list[Round], http_rounds: list[Round], sequential: Round, exit_code: int | None,
            args: argparse.Namespace) -> dict[str, Any]:
    """Throughput from each side's best round; per-request figures over the requests of every round."""
    direct, http = (max(rounds, key=lambda r: r.tok_s) for rounds in (direct_rounds, http_rounds))
    samples = [s for r in http_rounds for s in r.samples]
    direct_samples = [s for r in direct_rounds for s in r.samples]
    direct_prompt_tokens = [s.num_prompt_tokens for s in direct.samples]
    added = added_ms(samples)
    return {
        "http_vs_direct": round(http.tok_s / direct.tok_s, 3),
        "added_ms_p50": round(percentile(added, 50), 2),
        "added_ms_p95": round(percentile(added, 95), 2),
        "added_ms_p50_rounds": [round(percentile(added_ms(r.samples), 50), 2) for r in http_rounds],
        "added_ms_p50_sequential": round(percentile(added_ms(sequential.samples), 50), 2)
        if sequential.samples else None,
        "server_other_ms_p50": p50_ms([(s.server_s or 0.0) - (s.model_s or 0.0) for s in samples]),
        "transport_ms_p50": p50_ms([s.e2e_s - (s.server_s or 0.0) for s in samples]),
        "stage_ms_p50": {id_: p50_ms([s.stage_s.get(id_) for s in samples]) for id_ in samples[0].stage_s},
        "direct_tok_s": round(direct.tok_s, 1),
        "http_tok_s": round(http.tok_s, 1),
        "direct_ttft_ms_p50": p50_ms([s.ttft_s for s in direct_samples]),
        "http_ttft_ms_p50": p50_ms([s.ttft_s for s in samples]),
        "server_ttft_ms_p50": p50_ms([s.server_ttft_s for s in samples]),
        "direct_e2e_ms_p50": p50_ms([s.e2e_s for s in direct_samples]),
        "http_e2e_ms_p50": p50_ms([s.e2e_s for s in samples]),
        "direct_output_tokens": direct.num_output_tokens,
        "http_output_tokens": http.num_output_tokens,
        "prompt_tokens_match": all([s.num_prompt_tokens for s in r.samples] == direct_prompt_tokens
                                   for r in http_rounds),
        "server_exit_code": exit_code,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 clients and 16 tokens unless given (a smoke run)")
    p.add_argument("--clients", type=int, help="concurrent requests per round (default 32; --quick 8)")
    p.add_argument("--max-tokens", type=int, help="max_tokens per request, at most the pipeline's 256 "
                                                  "(default 64; --quick 16)")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved rounds per side: the best's throughput, every round's requests (default 3)")
    p.add_argument("--sequential", type=int, default=4,
                   help="requests sent one at a time after the rounds, for added_ms_p50_sequential (default 4)")
    p.add_argument("--config", default="inferline.yaml", help="server config (default inferline.yaml)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.clients = args.clients or (8 if args.quick else 32)
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    if args.clients < 1 or args.max_tokens < 1 or args.repeats < 1 or args.sequential < 0:
        parser().error("--clients, --max-tokens and --repeats must be at least 1, --sequential at least 0")
    result = asyncio.run(run(args))
    print(f"direct {result['direct_tok_s']} tok/s, http {result['http_tok_s']} tok/s "
          f"(x{result['http_vs_direct']}); added per request p50 {result['added_ms_p50']} ms, "
          f"p95 {result['added_ms_p95']} ms; server exit code {result['server_exit_code']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
