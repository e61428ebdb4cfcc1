"""Audit store cost: what the audit stage adds to a request on SQLite and PostgreSQL, and verify of 100k records.

    .venv/bin/python bench/audit.py [--quick] [--postgres-url URL] [--only sqlite|postgres|verify]

Records go through the real path, as the serving app writes them: the ``audit``
stage (stages/audit.py) builds each record from a request context shaped like a
RAG request (seven stages, two policy decisions, redacted 200-character
contents) and awaits the server's sink (serving/audit_sink.StoreSink: group
commit; store/audit.AuditStore.awrite_batch: PostgreSQL's call on the loop's
async connection, a SQLite file's write on the loop unless its lock is held
elsewhere) until the record is durable, on a store configured as the server's
defaults with a checkpoint key. What is timed is the stage's ``run``, from
building the record to its commit. First one request at a time, N of them (the
added latency's p50/p95; target p50 ≤ 1 ms), then N more from 16 concurrent
requests (p50/p95 per request, and records per commit: what group commit does).
On PostgreSQL, N/2 more from two stores taking turns, as two server processes
would at worst: each finds the chain head moved by the other
(store/audit/append.py).

Baseline on PostgreSQL, in the same run and interleaved with the sequential
writes: the commit floor, a one-row INSERT committed by one round trip on its
own connection (the WAL flush of a commit plus a round trip; nothing can
write durably for less). Then 100,000 chained records go to SQLite through the
bulk path (``write_many``) and ``verify`` is timed over them twice: as it runs
by default (worker processes hashing seq ranges in parallel, one per CPU) and,
the baseline, in one process (``workers=1``). The last line is one JSON object:
``audit_added_ms_p50_sqlite``, ``audit_added_ms_p50_postgres``, their p95s and
concurrent p50s, ``audit_added_ms_p50_sqlite_journal`` (the same stage with the
server's write-ahead journal, ``audit.journal``: the answer waits for the journal's
fsync, the chaining follows; its p95 and concurrent p50 too),
``audit_added_ms_p50_postgres_two_writers``,
``postgres_commit_floor_ms_p50``, ``verify_s_100k`` (target: under 10 s),
``verify_s_100k_one_process`` and ``verify_parallel_speedup`` (their ratio),
``verify_anchored_s_100k`` (target: under 10 s: the chain, its 100 Ed25519 checkpoints with the
public key alone, and the database against their digest files, as ``verify --public-key --anchors``)
with ``verify_anchored_vs_plain``, ``audit_added_ms_p50_sqlite_ed25519`` (the stage with Ed25519
checkpoints) with ``ed25519_vs_hmac_p50``, and ``audit_added_ms_p50_encrypted`` (target p50 ≤ 1 ms:
the stage as the server runs it, journal included, with Ed25519 checkpoints and ``content: encrypted``)
with ``encrypted_vs_redacted_p50`` (against the journaled run with ``content: redacted``),
with the machine's CPU pressure before and after (``/proc/pressure/cpu``, the
share of time something waited for a CPU): on a shared machine, other load
moves every figure here, the commit floor included.
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
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from pipeline.context import ChatMessage, Principal, RequestContext, StageRecord, Usage
from pipeline.protocols import Resources
from serving.backends.audit_sink import StoreSink
from serving.config.audit import AuditSpec
from stages.audit import AuditConfig, AuditStage, build_record
from store.audit import (
    Anchors,
    AuditStore,
    ContentVault,
    Ed25519Signer,
    Journal,
    Signer,
    Verifier,
    generate_pem,
    verify_anchors,
)
from store.engine import make_engine
from store.migrate import create_schema

POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
STAGES = ("policy", "retrieve", "route", "tokenize", "generate", "stream", "audit")
CONCURRENCY = 16
WARMUP = 50
CHECKPOINT_KEY = b"bench-checkpoint-key-32-bytes..."
SIGNER = Ed25519Signer.from_pem(generate_pem()[0])


def request_context(i: int) -> RequestContext:
    """The context a RAG request leaves for the audit stage: what the earlier stages wrote."""
    question = ("How do I rotate my API key? " * 8)[:200]
    ctx = RequestContext(pipeline=("support", "rag", "triage")[i % 3], input_messages=[ChatMessage("user", question)],
                         request_id=f"req-{i}", principal=Principal(f"key{i % 20:09d}", "caller"),
                         model="smol", finish_reason="stop", trace_id=uuid.uuid4().hex,
                         received_at=datetime.now(UTC) - timedelta(milliseconds=850), ttft_s=0.1205,
                         pipeline_version="7", spec_sha256="ab" * 32, client_addr="10.1.2.3",
                         usage=Usage(180 + i % 50, 90 + i % 30), status="denied" if i % 50 == 0 else "ok")
    ctx.output_text = ("Open Settings, then Keys, then Rotate. " * 6)[:200]
    ctx.stages = [StageRecord(f"s{n}", kind, "ok", duration_s=(1.5 + n) / 1e3) for n, kind in enumerate(STAGES)]
    ctx.stages[4].cost_usd = 0.000054 + (i % 9) * 1e-6
    ctx.ledger.add("s4", ctx.stages[4].cost_usd, "tokens")
    ctx.facts.update({
        "weights_hash": "cd" * 32, "sampling": {"temperature": 0.2, "top_p": 0.95, "max_tokens": 256, "seed": i},
        "route": {"decision": "smol", "reason": "prompt_tokens <= 1500", "fallbacks": ["remote"]},
        "retrieval": {"index": "handbook", "version": "2026-01", "doc_ids": ["h-12", "h-7", "h-3", "h-40"],
                      "scores": [0.81, 0.77, 0.64, 0.52]},
        "policy": [{"rule": "pii", "category": "pii", "action": "redact", "score": 0.91},
                   {"rule": "credentials", "category": "credentials", "action": "allow", "score": 0.02}],
        "decisions": {"s0": {"action": "redact"}},
        "redacted_input": question, "redacted_output": ctx.output_text,
    })
    return ctx


def request_record(i: int) -> dict[str, Any]:
    """A record as the audit stage writes it, for the bulk load that verify reads."""
    return build_record(request_context(i), AuditConfig(content="redacted"))


def percentiles(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {"p50": statistics.median(samples), "p95": samples[int(len(samples) * 0.95) - 1]}


def open_store(engine: sa.Engine, spool: Path, key: bytes | Signer = CHECKPOINT_KEY,
               master_key: bytes | None = None) -> AuditStore:
    """A store configured as the server's defaults (serving/audit_sink.open_store), with a checkpoint key
    (HMAC) or an Ed25519 signer, and with *master_key* a vault for ``content: encrypted``."""
    defaults = AuditSpec()
    create_schema(engine)
    return AuditStore(engine, spool_path=spool, mode=defaults.mode, checkpoint_key=key,
                      checkpoint_every=defaults.checkpoint_every,
                      vault=ContentVault(engine, master_key) if master_key else None)


async def stage_latencies(store: AuditStore, num_requests: int, floor: Callable[[], None] | None = None,
                          journal: Journal | None = None, content: str = "redacted") -> dict[str, Any]:
    """The audit stage's run, in ms: one request at a time, then CONCURRENCY at a time. With *journal*
    (as the server runs it), the stage waits for the journal's fsync, and the chaining follows."""
    sink = StoreSink(store, journal)
    commits = 0
    write_items = store.awrite_items

    async def counted(items: list[Any], strict: bool = False) -> None:
        nonlocal commits
        commits += 1
        await write_items(items, strict=strict)

    write_batch = store.awrite_batch

    async def counted_batch(records: Any) -> list[str]:  # the path without a journal
        nonlocal commits
        commits += 1
        return await write_batch(records)

    store.awrite_items = counted  # type: ignore[method-assign]  # the real methods, counted
    store.awrite_batch = counted_batch  # type: ignore[method-assign]
    stage = AuditStage("log", AuditConfig(content=content), Resources(audit=sink))
    for i in range(WARMUP):
        await stage.run(request_context(i), None)  # type: ignore[arg-type]
    sequential, floors = [], []
    for i in range(num_requests):
        ctx = request_context(i)
        start = time.perf_counter()
        await stage.run(ctx, None)  # type: ignore[arg-type]
        sequential.append((time.perf_counter() - start) * 1e3)
        if floor is not None:
            start = time.perf_counter()
            floor()
            floors.append((time.perf_counter() - start) * 1e3)

    concurrent: list[float] = []

    async def client(first: int) -> None:
        for i in range(first, num_requests, CONCURRENCY):
            ctx = request_context(i)
            start = time.perf_counter()
            await stage.run(ctx, None)  # type: ignore[arg-type]
            concurrent.append((time.perf_counter() - start) * 1e3)

    commits = 0
    await asyncio.gather(*(client(n) for n in range(CONCURRENCY)))
    if not await sink.flushed(timeout=60):
        raise SystemExit("the journaled records were not chained within a minute")
    if journal is not None:
        journal.close()
    report = store.verify()
    if not report.ok or report.checked != WARMUP + 2 * num_requests:
        raise SystemExit(f"verify failed after the write benchmark: {report.findings[:3]}")
    return {"sequential": percentiles(sequential), "concurrent": percentiles(concurrent),
            "records_per_commit": num_requests / commits, "floor": percentiles(floors) if floors else None}


async def two_writer_latencies(first: AuditStore, second: AuditStore, num_requests: int) -> dict[str, float]:
    """Two stores (two server processes, as far as each can tell) taking turns: each write finds the head moved."""
    stages = [AuditStage("log", AuditConfig(content="redacted"), Resources(audit=StoreSink(store)))
              for store in (first, second)]
    samples = []
    for i in range(WARMUP + num_requests):
        ctx = request_context(i)
        start = time.perf_counter()
        await stages[i % 2].run(ctx, None)  # type: ignore[arg-type]
        if i >= WARMUP:
            samples.append((time.perf_counter() - start) * 1e3)
    report = first.verify()
    if not report.ok:
        raise SystemExit(f"verify failed after the two-writer benchmark: {report.findings[:3]}")
    return percentiles(samples)


def postgres_engine(url: str) -> tuple[sa.Engine, str, str]:
    """An admin engine, a URL confined to a fresh schema, and that schema's name."""
    schema = f"inferline_bench_{uuid.uuid4().hex[:12]}"
    admin = make_engine(url)
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    scoped = make_url(url).update_query_dict({"options": f"-csearch_path={schema}"})
    return admin, scoped.render_as_string(hide_password=False), schema


def commit_floor(url: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """A one-row INSERT committed in one round trip on a psycopg connection of its own; and its closer."""
    conn = psycopg.connect(make_url(url).set(drivername="postgresql").render_as_string(hide_password=False),
                           autocommit=True)
    conn.execute("CREATE TABLE bench_commit_floor (id bigserial PRIMARY KEY, body text NOT NULL)")
    body = "x" * 200

    def insert() -> None:
        conn.execute("INSERT INTO bench_commit_floor (body) VALUES (%s)", (body,))

    return insert, conn.close


def verify_seconds(num_records: int, folder: Path) -> tuple[float, float, float]:
    """Seconds to verify *num_records*: as by default (parallel), in one process, and anchored: with the
    public key and against the digest files of its checkpoints (``verify --public-key --anchors``)."""
    engine = make_engine(f"sqlite:///{folder / 'verify.db'}")
    create_schema(engine)
    audit = AuditStore(engine, spool_path=folder / "verify.spool", checkpoint_key=SIGNER)
    for start in range(0, num_records, 5000):
        audit.write_many([request_record(i) for i in range(start, min(start + 5000, num_records))])
    anchors = Anchors(engine, folder / "digests", SIGNER)
    anchors.deliver()
    verifier = Verifier([SIGNER.public_pem()])
    elapsed = []
    for workers in (None, 1):
        began = time.perf_counter()
        report = audit.verify(workers=workers)
        elapsed.append(time.perf_counter() - began)
        if not report.ok or report.checked != num_records:
            raise SystemExit(f"verify (workers={workers}) failed: {report.findings[:3]}")
    began = time.perf_counter()
    report = audit.verify(checkpoint_key=verifier)
    anchored = verify_anchors(engine, anchors.folder, verifier)
    elapsed.append(time.perf_counter() - began)
    if not (report.ok and anchored.ok and report.unchecked_checkpoints == 0 and anchored.unchecked == 0
            and anchored.digests == num_records // AuditSpec().checkpoint_every):
        raise SystemExit(f"anchored verify failed: {report.findings[:3]} {anchored.findings[:3]}")
    engine.dispose()
    return elapsed[0], elapsed[1], elapsed[2]


def summarize(name: str, results: dict[str, Any], latency: dict[str, Any]) -> None:
    seq, conc = latency["sequential"], latency["concurrent"]
    print(f"{name:10s} stage p50 {seq['p50']:.3f} ms  p95 {seq['p95']:.3f} ms  |  {CONCURRENCY} concurrent: "
          f"p50 {conc['p50']:.3f} ms  p95 {conc['p95']:.3f} ms, {latency['records_per_commit']:.1f} records/commit",
          flush=True)
    results |= {f"audit_added_ms_p50_{name}": round(seq["p50"], 4), f"audit_added_ms_p95_{name}": round(seq["p95"], 4),
                f"audit_added_ms_p50_{name}_concurrent": round(conc["p50"], 4),
                f"records_per_commit_{name}_concurrent": round(latency["records_per_commit"], 2)}


def run_sqlite(results: dict[str, Any], num_writes: int, folder: Path) -> None:
    sqlite = make_engine(f"sqlite:///{folder / 'audit.db'}")
    journaled = make_engine(f"sqlite:///{folder / 'journaled.db'}")
    signed = make_engine(f"sqlite:///{folder / 'signed.db'}")
    sealed = make_engine(f"sqlite:///{folder / 'sealed.db'}")
    try:
        latency = asyncio.run(stage_latencies(open_store(sqlite, folder / "sqlite.spool"), num_writes))
        # The same with Ed25519 checkpoints instead of HMAC (one signature per checkpoint_every records).
        latency_ed25519 = asyncio.run(stage_latencies(open_store(signed, folder / "signed.spool", SIGNER),
                                                      num_writes))
        # As the server runs it (audit.journal): the answer waits for the journal's fsync only.
        latency_journal = asyncio.run(stage_latencies(open_store(journaled, folder / "journaled.spool"),
                                                      num_writes, journal=Journal.open(folder / "journal")))
        # The same with Ed25519 checkpoints and content: encrypted (a data key per caller key, 20 of them).
        latency_encrypted = asyncio.run(stage_latencies(
            open_store(sealed, folder / "sealed.spool", SIGNER, master_key=os.urandom(32)), num_writes,
            journal=Journal.open(folder / "sealed-journal"), content="encrypted"))
    finally:
        sqlite.dispose()
        journaled.dispose()
        signed.dispose()
        sealed.dispose()
    summarize("sqlite", results, latency)
    summarize("sqlite_ed25519", results, latency_ed25519)
    results["ed25519_vs_hmac_p50"] = round(latency_ed25519["sequential"]["p50"] / latency["sequential"]["p50"], 3)
    summarize("sqlite_journal", results, latency_journal)
    summarize("sqlite_journal_encrypted", results, latency_encrypted)
    results["audit_added_ms_p50_encrypted"] = results["audit_added_ms_p50_sqlite_journal_encrypted"]
    results["encrypted_vs_redacted_p50"] = round(latency_encrypted["sequential"]["p50"]
                                                 / latency_journal["sequential"]["p50"], 3)


def run_postgres(results: dict[str, Any], num_writes: int, folder: Path, base_url: str) -> None:
    admin, url, schema = postgres_engine(base_url)
    postgres, again = make_engine(url), make_engine(url)
    floor, close_floor = commit_floor(url)
    try:
        store = open_store(postgres, folder / "postgres.spool")
        latency = asyncio.run(stage_latencies(store, num_writes, floor))
        two_writers = asyncio.run(two_writer_latencies(store, open_store(again, folder / "again.spool"),
                                                       num_writes // 2))
    finally:
        close_floor()
        postgres.dispose()
        again.dispose()
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
    summarize("postgres", results, latency)
    print(f"postgresql commit floor (one-row INSERT, one round trip) p50 {latency['floor']['p50']:.3f} ms  "
          f"p95 {latency['floor']['p95']:.3f} ms", flush=True)
    print(f"postgresql, two writers taking turns: stage p50 {two_writers['p50']:.3f} ms  "
          f"p95 {two_writers['p95']:.3f} ms", flush=True)
    results["postgres_commit_floor_ms_p50"] = round(latency["floor"]["p50"], 4)
    results["audit_added_ms_p50_postgres_two_writers"] = round(two_writers["p50"], 4)


def cpu_pressure() -> float | None:
    """Linux's share of the last 60 s in which something waited for a CPU (%): other load on the machine."""
    try:
        return float(Path("/proc/pressure/cpu").read_text().split()[2].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 writes and 10,000 records to verify")
    parser.add_argument("--postgres-url", default=POSTGRES_URL)
    parser.add_argument("--only", choices=("sqlite", "postgres", "verify"), help="run one part only")
    args = parser.parse_args()
    num_writes, num_verify = (1_000, 10_000) if args.quick else (10_000, 100_000)
    results: dict[str, Any] = {"writes": num_writes, "concurrency": CONCURRENCY,
                               "cpu_pressure_avg60_before": cpu_pressure()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.only in (None, "sqlite"):
            run_sqlite(results, num_writes, folder)
        if args.only in (None, "postgres"):
            run_postgres(results, num_writes, folder, args.postgres_url)
        if args.only in (None, "verify"):
            seconds, one_process, anchored = verify_seconds(num_verify, folder)
            print(f"verify of {num_verify} records: {seconds:.2f} s ({one_process:.2f} s in one process, "
                  f"{anchored:.2f} s with the public key and the digests)", flush=True)
            results["verify_s_100k"] = round(seconds * 100_000 / num_verify, 3)
            results["verify_anchored_s_100k"] = round(anchored * 100_000 / num_verify, 3)
            results["verify_anchored_vs_plain"] = round(anchored / seconds, 3)
            results["verify_s_100k_one_process"] = round(one_process * 100_000 / num_verify, 3)
            results["verify_parallel_speedup"] = round(one_process / seconds, 3)
            results["verify_records"] = num_verify
    results["cpu_pressure_avg60_after"] = cpu_pressure()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
