"""Load and soak: N streaming clients for T minutes against a real ``inferline serve``, auth and audit on.

    .venv/bin/python bench/load.py [--quick] [--clients N] [--minutes T] [--max-tokens M] [--seed S]

The server is the repository's default ``inferline.yaml`` (the real model, SmolLM2-135M-Instruct, on our
engine) with ``auth: {enabled: true}`` and its database in a temporary folder; a ``caller`` key is made with
``inferline keys create``. Every request is ``POST /pipelines/chat`` with ``"stream": true``, read as
Server-Sent Events to its ``done`` (or ``error``) event; the chat pipeline's ``audit`` stage writes one
record per request (``content: hash``: the SHA-256 of the input). Each input carries a unique request
number, so records are matched to requests one for one by that hash.

1. warm-up: one burst of N requests of full length, so that the batch, the allocator's buffers and the
   prefix cache reach the size the load keeps them at; then the server's RSS is read (``rss_start_mb``);
2. load: N clients (128; 16 with --quick), each sending its next request as soon as the last one ended,
   until T minutes (10; 0.5 with --quick) have passed; requests already sent then finish;
3. ``rss_end_mb``; SIGTERM (exit status ``server_exit_code``); the audit log is read from the database.

Figures (the last line of stdout is one JSON object with them all):
  requests_sent / requests_completed     every request sent (warm-up included) / ended with ``done``
  status_429_with_retry_after            refusals by a full queue, as designed
  status_429_without_retry_after         429s missing Retry-After: a bug (target 0)
  status_5xx, stream_errors, transport_errors   server errors, ``error`` events after a 200, and
                                         connections that failed (target 0 each)
  ttft_ms_p50/p95/p99, e2e_ms_p50/p95/p99  request sent -> first ``delta`` / -> ``done``, load phase only
  tokens_per_s                           output tokens of the load phase over its wall time
  rss_start_mb, rss_end_mb, rss_growth_pct  the server's memory after warm-up and after the load (target < 5%);
                                         rss_samples_mb: every 30 s of the load, to tell a plateau from a leak
  audit_records, audit_missing, audit_duplicated, audit_unmatched  records of this run's requests (target:
                                         = requests_sent, then 0, 0, 0); audit_verify_ok: the hash chain checks
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ holds http.py, which would shadow the standard library's http package; the repository root
# must be importable (serving, store, bench.server_process).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse
import asyncio
import hashlib
import json
import math
import random
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import sqlalchemy as sa

from bench.server_process import ServerProcess
from store.audit import AuditStore
from store.engine import make_engine

PIPELINE = "chat"
REQUEST_TIMEOUT_S = 600.0
TOPICS = (
    "the capital of France", "why the sky is blue", "how vaccines work", "photosynthesis", "gravity",
    "the seasons", "rainbows", "black holes", "why cats purr", "how bees make honey", "the speed of light",
    "atoms", "how planes fly", "machine learning", "why the ocean is salty", "the water cycle", "magnets",
    "DNA", "volcanoes", "inflation", "how a compass works", "the planets", "how fish breathe",
)


@dataclass(slots=True)
class Outcome:
    """What one client saw of one request."""

    input: str
    status: int | None = None
    retry_after: str | None = None
    done: bool = False
    stream_error: bool = False
    transport_error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0


@dataclass
class Run:
    """Every outcome, by phase."""

    warmup: list[Outcome] = field(default_factory=list)
    load: list[Outcome] = field(default_factory=list)
    load_wall_s: float = 0.0
    rss_start: int = 0
    rss_end: int = 0
    rss_samples: list[int] = field(default_factory=list)
    exit_code: int | None = None
    audit: dict[str, Any] = field(default_factory=dict)

    @property
    def all(self) -> list[Outcome]:
        return self.warmup + self.load


def make_input(number: int, rng: random.Random) -> str:
    # A unique number in every input: its SHA-256 (the audit record's input_content) names the request.
    return f"Request {number}: in two or three sentences, tell me about {rng.choice(TOPICS)}."


async def one_request(client: httpx.AsyncClient, text: str, max_tokens: int) -> Outcome:
    outcome = Outcome(text)
    body = {"input": text, "stream": True, "max_tokens": max_tokens}
    started = time.perf_counter()
    event = ""
    try:
        async with client.stream("POST", f"/pipelines/{PIPELINE}", json=body) as response:
            outcome.status = response.status_code
            outcome.retry_after = response.headers.get("retry-after")
            if response.status_code != 200:
                await response.aread()
                return outcome
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif not line.startswith("data:"):
                    continue
                elif event == "delta" and outcome.ttft_s is None:
                    outcome.ttft_s = time.perf_counter() - started
                elif event == "done":
                    outcome.done = True
                    outcome.output_tokens = json.loads(line[5:])["usage"]["output_tokens"]
                elif event == "error":
                    outcome.stream_error = True
    except httpx.HTTPError as exc:
        outcome.transport_error = type(exc).__name__
    outcome.e2e_s = time.perf_counter() - started
    return outcome


class Numbers:
    """Request numbers, unique across the run's clients."""

    def __init__(self) -> None:
        self.next = 0

    def take(self) -> int:
        self.next += 1
        return self.next


async def client_loop(client: httpx.AsyncClient, deadline: float, numbers: Numbers, rng: random.Random,
                      max_tokens: int, out: list[Outcome]) -> None:
    while time.monotonic() < deadline:
        out.append(await one_request(client, make_input(numbers.take(), rng), rng.randint(max_tokens // 2,
                                                                                          max_tokens)))


async def drive(server: ServerProcess, key: str, args: argparse.Namespace, run: Run) -> None:
    rng = random.Random(args.seed)
    numbers = Numbers()
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {key}"},
                                 timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits,
                                 trust_env=False) as client:
        run.warmup = list(await asyncio.gather(*(one_request(client, make_input(numbers.take(), rng),
                                                             args.max_tokens) for _ in range(args.clients))))
        run.rss_start = server.rss_bytes()
        warm = args.clients
        print(f"warm-up: {sum(o.done for o in run.warmup)}/{warm} done; server RSS "
              f"{run.rss_start / 2**20:.0f} MiB; load: {args.clients} clients for {args.minutes:g} min", flush=True)
        started = time.monotonic()
        deadline = started + args.minutes * 60
        progress = asyncio.create_task(report_progress(server, run, started, deadline))
        try:
            await asyncio.gather(*(client_loop(client, deadline, numbers, random.Random(rng.random()),
                                               args.max_tokens, run.load) for _ in range(args.clients)))
        finally:
            progress.cancel()
        run.load_wall_s = time.monotonic() - started
        run.rss_end = server.rss_bytes()


async def report_progress(server: ServerProcess, run: Run, started: float, deadline: float) -> None:
    while True:
        await asyncio.sleep(30)
        done = sum(o.done for o in run.load)
        run.rss_samples.append(server.rss_bytes())
        print(f"  {time.monotonic() - started:5.0f} s: {len(run.load)} requests ended, {done} done, server RSS "
              f"{run.rss_samples[-1] / 2**20:.0f} MiB ({max(0.0, deadline - time.monotonic()):.0f} s of load left)",
              flush=True)


def read_audit(url: str, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """This run's requests against the audit records: matched by the SHA-256 of each input."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT input_content, status FROM audit_records "
                                        "WHERE kind = 'record' AND pipeline = :p"), {"p": PIPELINE}).all()
        report = AuditStore(engine, spool_path=Path(tempfile.gettempdir()) / "unused-audit-spool").verify()
    finally:
        engine.dispose()
    sent = Counter(hashlib.sha256(o.input.encode()).hexdigest() for o in outcomes)
    seen = Counter(row[0] for row in rows)
    return {"records": len(rows), "missing": sum((sent - seen).values()),
            "duplicated": sum(max(0, n - 1) for n in seen.values()), "unmatched": sum((seen - sent).values()),
            "verify_ok": report.ok, "by_status": dict(Counter(row[1] for row in rows))}


def percentiles_ms(values: Sequence[float | None]) -> dict[str, float | None]:
    present = sorted(v for v in values if v is not None)

    def rank(q: float) -> float | None:  # nearest rank
        return round(present[max(0, math.ceil(q / 100 * len(present)) - 1)] * 1e3, 1) if present else None

    return {"p50": rank(50), "p95": rank(95), "p99": rank(99)}


def summary(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    everything = run.all
    ttft = percentiles_ms([o.ttft_s for o in run.load if o.done])
    e2e = percentiles_ms([o.e2e_s for o in run.load if o.done])
    growth = (run.rss_end - run.rss_start) / run.rss_start * 100 if run.rss_start else None
    return {
        "requests_sent": len(everything),
        "requests_completed": sum(o.done for o in everything),
        "status_429_with_retry_after": sum(o.status == 429 and o.retry_after is not None for o in everything),
        "status_429_without_retry_after": sum(o.status == 429 and o.retry_after is None for o in everything),
        "status_5xx": sum(o.status is not None and o.status >= 500 for o in everything),
        "other_4xx": sum(o.status is not None and 400 <= o.status < 500 and o.status != 429 for o in everything),
        "stream_errors": sum(o.stream_error for o in everything),
        "transport_errors": sum(o.transport_error is not None for o in everything),
        "ttft_ms_p50": ttft["p50"], "ttft_ms_p95": ttft["p95"], "ttft_ms_p99": ttft["p99"],
        "e2e_ms_p50": e2e["p50"], "e2e_ms_p95": e2e["p95"], "e2e_ms_p99": e2e["p99"],
        "tokens_per_s": round(sum(o.output_tokens for o in run.load) / run.load_wall_s, 1) if run.load_wall_s else None,
        "requests_per_s": round(sum(o.done for o in run.load) / run.load_wall_s, 2) if run.load_wall_s else None,
        "rss_start_mb": round(run.rss_start / 2**20, 1), "rss_end_mb": round(run.rss_end / 2**20, 1),
        "rss_growth_pct": None if growth is None else round(growth, 2),
        "rss_samples_mb": [round(sample / 2**20) for sample in run.rss_samples],
        "audit_records": run.audit.get("records"), "audit_missing": run.audit.get("missing"),
        "audit_duplicated": run.audit.get("duplicated"), "audit_unmatched": run.audit.get("unmatched"),
        "audit_verify_ok": run.audit.get("verify_ok"),
        "audit_by_status": run.audit.get("by_status"),
        "server_exit_code": run.exit_code,
        "clients": args.clients, "minutes": args.minutes, "max_tokens": args.max_tokens,
        "load_wall_s": round(run.load_wall_s, 1),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    run = Run()
    with tempfile.TemporaryDirectory(prefix="inferline-load-") as tmp:
        server = ServerProcess.start(Path(tmp), auth=True)
        try:
            key = server.key("caller", "load-bench")
            asyncio.run(drive(server, key, args, run))
        finally:
            run.exit_code = server.stop()
        if args.keep_log:
            print(f"server log:\n{server.log_tail(20_000)}", file=sys.stderr)
        run.audit = read_audit(f"sqlite:///{tmp}/server.db", run.all)
    return summary(run, args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="16 clients for 0.5 minutes unless given")
    p.add_argument("--clients", type=int, help="concurrent streaming clients (default 128; --quick 16)")
    p.add_argument("--minutes", type=float, help="length of the load phase (default 10; --quick 0.5)")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="each request asks for a random max_tokens in [M/2, M] (default 64)")
    p.add_argument("--seed", type=int, default=13, help="seed of the requests' topics and lengths")
    p.add_argument("--keep-log", action="store_true", help="print the server's log to stderr at the end")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.clients = args.clients or (16 if args.quick else 128)
    args.minutes = args.minutes if args.minutes is not None else (0.5 if args.quick else 10.0)
    if args.clients < 1 or args.minutes <= 0 or args.max_tokens < 2:
        parser().error("--clients must be at least 1, --minutes above 0, --max-tokens at least 2")
    result = measure(args)
    print(f"{result['requests_completed']}/{result['requests_sent']} requests done; 5xx {result['status_5xx']}; "
          f"429 {result['status_429_with_retry_after']} (+{result['status_429_without_retry_after']} without "
          f"Retry-After); TTFT p50/p99 {result['ttft_ms_p50']}/{result['ttft_ms_p99']} ms; "
          f"{result['tokens_per_s']} tok/s; RSS {result['rss_start_mb']} -> {result['rss_end_mb']} MiB "
          f"({result['rss_growth_pct']}%); audit {result['audit_records']} records, "
          f"{result['audit_missing']} missing, {result['audit_duplicated']} duplicated")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
