"""Audit store cost: per-request write latency on SQLite and PostgreSQL, and verify time for 100k records.

    .venv/bin/python bench/audit.py [--quick] [--postgres-url URL]

Writes N records shaped like real requests (seven stages, policy decisions,
200-character contents) one at a time through ``AuditStore.write`` and reports
the added latency's p50/p95 per backend; then writes 100,000 chained records to
SQLite through the bulk path (``write_many``) and times ``verify`` over them.
The last line is one JSON object: ``audit_added_ms_p50_sqlite``,
``audit_added_ms_p50_postgres``, their p95s and ``verify_s_100k``. Targets:
p50 ≤ 1 ms on SQLite, verify of 100k under 10 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds http.py, which would shadow the standard library's http
# package (imported by torch, httpx...) for any script run from here.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from store.audit import AuditStore
from store.db import create_schema, make_engine

POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
STAGES = ("policy", "retrieve", "route", "tokenize", "generate", "stream", "audit")


def request_record(i: int) -> dict[str, Any]:
    """A record like the audit stage writes for one RAG request."""
    start = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=i)
    return {
        "received_at": start, "completed_at": start + timedelta(milliseconds=850),
        "first_token_at": start + timedelta(milliseconds=120), "duration_ms": 850.0 + i % 7, "ttft_ms": 120.5,
        "key_id": f"key{i % 20:09d}", "role": "caller", "client_addr": "10.1.2.3",
        "pipeline": ("support", "rag", "triage")[i % 3], "pipeline_version": "7", "spec_sha256": "ab" * 32,
        "model": "smol", "weights_hash": "cd" * 32,
        "params": {"temperature": 0.2, "top_p": 0.95, "max_tokens": 256, "seed": i},
        "input_tokens": 180 + i % 50, "output_tokens": 90 + i % 30, "cost_usd": 0.000054 + (i % 9) * 1e-6,
        "route": {"decision": "smol", "reason": "prompt_tokens <= 1500", "fallbacks": ["remote"]},
        "retrieval": {"index": "handbook", "version": "2026-01", "doc_ids": ["h-12", "h-7", "h-3", "h-40"],
                      "scores": [0.81, 0.77, 0.64, 0.52]},
        "policy": [{"rule": "pii", "category": "pii", "action": "redact", "score": 0.91},
                   {"rule": "credentials", "category": "credentials", "action": "allow", "score": 0.02}],
        "status": "denied" if i % 50 == 0 else "ok", "finish_reason": "stop", "http_status": 200,
        "content_mode": "redacted", "input_content": ("How do I rotate my API key? " * 8)[:200],
        "output_content": ("Open Settings, then Keys, then Rotate. " * 6)[:200],
        "request_id": f"req-{i}", "trace_id": uuid.uuid4().hex,
        "stages": [{"stage_id": f"s{n}", "type": kind, "status": "ok", "duration_ms": 1.5 + n, "cost_usd": 0.0,
                    "decision": {"action": "redact"} if kind == "policy" else None}
                   for n, kind in enumerate(STAGES)],
    }


def write_latencies(engine: sa.Engine, num_records: int, spool: Path) -> dict[str, float]:
    """p50/p95 of AuditStore.write, in ms, after a short warm-up."""
    create_schema(engine)
    audit = AuditStore(engine, spool_path=spool)
    for i in range(50):
        audit.write(request_record(i))
    samples = []
    for i in range(num_records):
        record = request_record(i)
        start = time.perf_counter()
        audit.write(record)
        samples.append((time.perf_counter() - start) * 1e3)
    if not audit.verify().ok:
        raise SystemExit("verify failed after the write benchmark")
    samples.sort()
    return {"p50": statistics.median(samples), "p95": samples[int(len(samples) * 0.95) - 1]}


def postgres_engine(url: str) -> tuple[sa.Engine, sa.Engine, str]:
    """An admin engine, an engine confined to a fresh schema, and that schema's name."""
    schema = f"inferline_bench_{uuid.uuid4().hex[:12]}"
    admin = make_engine(url)
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    scoped = make_url(url).update_query_dict({"options": f"-csearch_path={schema}"})
    return admin, make_engine(scoped.render_as_string(hide_password=False)), schema


def verify_seconds(num_records: int, folder: Path) -> float:
    engine = make_engine(f"sqlite:///{folder / 'verify.db'}")
    create_schema(engine)
    audit = AuditStore(engine, spool_path=folder / "verify.spool")
    for start in range(0, num_records, 5000):
        audit.write_many([request_record(i) for i in range(start, min(start + 5000, num_records))])
    began = time.perf_counter()
    report = audit.verify()
    elapsed = time.perf_counter() - began
    engine.dispose()
    if not report.ok or report.checked != num_records:
        raise SystemExit(f"verify failed: {report.findings[:3]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 writes and 10,000 records to verify")
    parser.add_argument("--postgres-url", default=POSTGRES_URL)
    args = parser.parse_args()
    num_writes, num_verify = (1_000, 10_000) if args.quick else (10_000, 100_000)
    results: dict[str, Any] = {"writes": num_writes}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sqlite = make_engine(f"sqlite:///{folder / 'audit.db'}")
        latency = write_latencies(sqlite, num_writes, folder / "sqlite.spool")
        sqlite.dispose()
        print(f"sqlite     write p50 {latency['p50']:.3f} ms  p95 {latency['p95']:.3f} ms", flush=True)
        results |= {"audit_added_ms_p50_sqlite": round(latency["p50"], 4),
                    "audit_added_ms_p95_sqlite": round(latency["p95"], 4)}
        admin, postgres, schema = postgres_engine(args.postgres_url)
        try:
            latency = write_latencies(postgres, num_writes, folder / "postgres.spool")
        finally:
            postgres.dispose()
            with admin.begin() as conn:
                conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
            admin.dispose()
        print(f"postgresql write p50 {latency['p50']:.3f} ms  p95 {latency['p95']:.3f} ms", flush=True)
        results |= {"audit_added_ms_p50_postgres": round(latency["p50"], 4),
                    "audit_added_ms_p95_postgres": round(latency["p95"], 4)}
        seconds = verify_seconds(num_verify, folder)
        print(f"verify of {num_verify} records: {seconds:.2f} s", flush=True)
        results["verify_s_100k"] = round(seconds * 100_000 / num_verify, 3)
        results["verify_records"] = num_verify
    print(json.dumps(results))


if __name__ == "__main__":
    main()
