"""The audit database goes away under load and comes back: no record lost, none written twice.

A real ``inferline serve`` (the real model, auth on) keeps its keys and audit log in a fresh schema of
the test PostgreSQL on 127.0.0.1:5432, reached through a TCP proxy this test owns: stopping the proxy
refuses new connections and resets the open ones, which is what the server sees of a database that
stopped; the machine's PostgreSQL itself is never touched. The outage lasts
``$RELIABILITY_DB_OUTAGE_S`` seconds (8 here; ``make reliability`` runs 30).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from bench.server_process import ServerProcess
from store.audit import AuditStore
from store.engine import make_engine
from tests.faults.netfaults import TcpProxy
from tests.faults.replies import Reply, audit_rows, post_stream, records_by_input, sha256

pytestmark = [pytest.mark.slow, pytest.mark.integration]

POSTGRES_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
OUTAGE_S = float(os.environ.get("RELIABILITY_DB_OUTAGE_S", "8"))
NUM_CLIENTS = 6


@dataclass
class Database:
    direct_url: str
    """The schema, straight to PostgreSQL."""
    proxied_url: str
    """The same schema through the proxy: what the server uses."""
    proxy: TcpProxy


@pytest.fixture
def database() -> Iterator[Database]:
    schema = f"inferline_fault_{uuid.uuid4().hex[:12]}"
    base = make_url(POSTGRES_URL).update_query_dict({"connect_timeout": "3"})
    admin = make_engine(base.render_as_string(hide_password=False))
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        pytest.fail(f"PostgreSQL at {base.render_as_string()} is unreachable:\n{str(exc.orig).strip()}\n"
                    "Start it, or deselect these tests with -m 'not integration'.", pytrace=False)
    url = base.update_query_dict({"options": f"-csearch_path={schema}"})
    proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432)).start()
    try:
        yield Database(url.render_as_string(hide_password=False),
                       url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False), proxy)
    finally:
        proxy.close()
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


async def test_database_outage_under_load_loses_and_duplicates_no_audit_record(database, tmp_path):
    server = ServerProcess.start(tmp_path, auth=True, database=database.proxied_url)
    try:
        key = server.key("caller")
        replies = await run_outage(server, key, database.proxy)
    finally:
        code = server.stop()
    log = server.log_path.read_text()
    assert code == 0, log[-4000:]
    # The outage really hit the audit writes: records went to the spool and were replayed from it.
    assert "audit database unavailable, spooling" in log and "replayed" in log, log[-4000:]
    during = [r for r in replies if r.input.startswith("outage")]
    assert during, "no request was sent while the database was away"
    # best_effort audit and keys verified before the outage: the API keeps serving meanwhile.
    assert all(r.status == 200 and r.done is not None for r in replies), [r for r in replies if r.done is None][:3]
    counts = records_by_input(audit_rows(database.direct_url, ["chat"]))
    assert counts == {sha256(r.input): 1 for r in replies}  # none lost, none twice, none unknown
    spool = tmp_path / "audit-spool.jsonl"
    assert not spool.exists() or spool.stat().st_size == 0
    assert not (tmp_path / "audit-spool.jsonl.rejected").exists()
    engine = make_engine(database.direct_url)
    try:
        report = AuditStore(engine, spool_path=tmp_path / "verify-spool.jsonl").verify()
    finally:
        engine.dispose()
    assert report.ok, report.findings[:5]
    assert report.checked == len(replies)


async def run_outage(server: ServerProcess, key: str, proxy: TcpProxy) -> list[Reply]:
    """Load before, during and after an outage of OUTAGE_S seconds; every request's reply."""
    replies: list[Reply] = []
    phase = {"name": "before"}
    stop = asyncio.Event()

    async def client_loop(client: httpx.AsyncClient, n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            text = f"{phase['name']} {n}.{i}: name one animal that lives in the sea."
            replies.append(await post_stream(client, "/pipelines/chat", {"input": text, "max_tokens": 12}))

    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {key}"},
                                 timeout=httpx.Timeout(120), trust_env=False) as client:
        clients = [asyncio.create_task(client_loop(client, n)) for n in range(NUM_CLIENTS)]
        try:
            while sum(r.done is not None for r in replies) < 2 * NUM_CLIENTS:
                await asyncio.sleep(0.2)
            phase["name"] = "outage"
            proxy.stop()
            await asyncio.sleep(OUTAGE_S)
            phase["name"] = "after"
            proxy.start()
            back = time.monotonic()
            while time.monotonic() - back < 5 or sum(r.input.startswith("after") for r in replies) < NUM_CLIENTS:
                await asyncio.sleep(0.2)
        finally:
            stop.set()
            await asyncio.gather(*clients)
        # One more once everything settled: its write replays whatever the spool still holds.
        replies.append(await post_stream(client, "/pipelines/chat", {"input": "last: say goodbye.", "max_tokens": 4}))
    return replies
