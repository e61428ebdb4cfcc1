"""Faults against one real ``inferline serve`` (the real model, auth and audit on), in this order:
the engine raising mid-batch, a remote backend that hangs, clients leaving at random points, and
last SIGTERM under load (which ends the module's server).

The server runs the default ``inferline.yaml`` plus two things only tests add: ``plugins:
[tests.faults.engine_fault]`` (the engine's step raises for a marked prompt) and a model ``hung``
whose OpenAI-compatible backend accepts connections and never answers.
"""

from __future__ import annotations

import asyncio
import json
import random
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.server_process import ROOT, ServerProcess
from tests.faults import engine_fault
from tests.faults.netfaults import HangingServer
from tests.faults.replies import Reply, audit_rows, post_stream, records_by_input, sha256

pytestmark = [pytest.mark.slow, pytest.mark.integration]

MAX_NUM_SEQS = 4
FALLBACK = """
name: fallback
description: A remote model that hangs, then the local one.
stages:
  - {id: prompt, type: prompt}
  - {id: pick, type: route, with: {default: hung, fallback: [smol], first_token_timeout_s: 1.5}}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 16, temperature: 0}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true}
"""
NO_FALLBACK = """
name: stuck
description: The hanging remote model alone.
stages:
  - {id: prompt, type: prompt}
  - {id: pick, type: route, with: {default: hung, first_token_timeout_s: 1.5}}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 16, temperature: 0}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true}
"""


class Served:
    """The module's server, its keys and its hanging backend."""

    def __init__(self, tmp: Path, hung: HangingServer):
        pipelines = tmp / "pipelines"
        pipelines.mkdir()
        (pipelines / "chat.yaml").write_text((ROOT / "pipelines" / "chat.yaml").read_text())
        (pipelines / "fallback.yaml").write_text(textwrap.dedent(FALLBACK))
        (pipelines / "stuck.yaml").write_text(textwrap.dedent(NO_FALLBACK))
        settings = {
            "plugins": ["tests.faults.engine_fault"],
            # Some requests must wait while a batch fails: a small batch cap.
            "models": {"smol": {"batching": {"max_num_seqs": MAX_NUM_SEQS}},
                       "hung": {"backend": "openai", "base_url": hung.url, "remote_model": "anything",
                                "timeout_s": 3}},
        }
        self.db_url = f"sqlite:///{tmp}/server.db"
        self.hung = hung
        self.server = ServerProcess.start(tmp, auth=True, pipelines=pipelines, settings=settings, wait=False)
        self.server.wait_ready()
        self.caller = self.server.key("caller")
        self.auditor = self.server.key("auditor")

    def client(self, key: str | None = None, timeout_s: float = 180.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.server.url, headers={"Authorization": f"Bearer {key or self.caller}"},
                                 timeout=httpx.Timeout(timeout_s), trust_env=False,
                                 limits=httpx.Limits(max_connections=64))


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    with HangingServer() as hung:
        running = Served(tmp_path_factory.mktemp("faults"), hung)
        try:
            yield running
        finally:
            running.server.stop()


async def ready_stats(served: Served) -> dict:
    async with served.client() as client:
        return (await client.get("/readyz")).json()["models"]["smol"]


async def wait_idle(served: Served, timeout_s: float = 60.0) -> dict:
    """The engine's stats once nothing runs, waits or holds KV blocks (or the last seen at *timeout_s*)."""
    deadline = time.monotonic() + timeout_s
    stats = await ready_stats(served)
    while time.monotonic() < deadline and (stats["running"], stats["waiting"], stats["kv_usage"]) != (0, 0, 0.0):
        await asyncio.sleep(0.2)
        stats = await ready_stats(served)
    return stats


def chained_rows(served: Served, pipelines: tuple[str, ...]) -> list[dict]:
    """The audit rows of *pipelines* in the database, once the server has chained every record of the
    requests it answered: its audit API waits for that before a read (the records go through its
    journal first, docs/audit.md "When a record is written")."""
    httpx.get(f"{served.server.url}/audit/records", params={"limit": 1},
              headers={"Authorization": f"Bearer {served.auditor}"}, trust_env=False).raise_for_status()
    return audit_rows(served.db_url, pipelines)


def records_for(served: Served, replies: list[Reply], pipelines: tuple[str, ...] = ("chat",)) -> list[dict]:
    wanted = {sha256(r.input) for r in replies}
    if served.server.proc.poll() is not None:  # stopped: its shutdown chained everything
        rows = audit_rows(served.db_url, pipelines)
    else:
        rows = chained_rows(served, pipelines)
    return [row for row in rows if row["input_content"] in wanted]


async def test_engine_raising_mid_batch_fails_its_batch_only(served):
    poisoned = {"input": f"{engine_fault.MARKER}: tell me a long story about a lighthouse.", "max_tokens": 48}
    others = [{"input": f"Fault test {i}: name a colour and say why you like it.", "max_tokens": 24}
              for i in range(2 * MAX_NUM_SEQS)]
    async with served.client() as client:
        first = asyncio.create_task(post_stream(client, "/pipelines/chat", poisoned))
        await asyncio.sleep(0.3)  # the marked request is admitted first; the others queue behind the batch cap
        replies = await asyncio.gather(first, *(post_stream(client, "/pipelines/chat", body) for body in others))
        after = await post_stream(client, "/pipelines/chat", {"input": "After the fault: say hello.",
                                                              "max_tokens": 8})
    marked, rest = replies[0], replies[1:]
    assert marked.status == 200 and marked.error is not None, marked
    assert marked.text, "the fault must come mid-stream, after some text"
    assert "the engine failed while running this request" in marked.error["detail"]
    assert engine_fault.MESSAGE in marked.error["detail"]
    failed = [r for r in rest if r.done is None]
    # Only the batch the step was running fails (at most MAX_NUM_SEQS requests, the marked one among them),
    # with the same clear error; the requests waiting behind it finish.
    assert len(failed) <= MAX_NUM_SEQS - 1
    for reply in failed:
        assert reply.error is not None and "the engine failed while running this request" in reply.error["detail"]
    assert all(r.done["finish_reason"] in ("stop", "length") for r in rest if r.done is not None)
    assert after.done is not None, after  # the server stays up, the engine keeps serving
    assert (await wait_idle(served))["kv_usage"] == 0.0
    rows = records_for(served, [*replies, after])
    assert records_by_input(rows) == {sha256(r.input): 1 for r in [*replies, after]}
    failed_inputs = {sha256(r.input) for r in [marked, *failed]}
    assert {(row["status"], row["error_type"]) for row in rows if row["input_content"] in failed_inputs} == {
        ("failed", "backend_error")}


async def test_a_hanging_remote_times_out_and_falls_back(served):
    async with served.client() as client:
        reply = await post_stream(client, "/pipelines/fallback", {"input": "Hang test: what is 2 + 2?"})
        stuck = await client.post("/pipelines/stuck", json={"input": "Hang test without fallback."})
    assert reply.done is not None, reply
    assert reply.text and served.hung.num_connections >= 1  # the remote was tried, and hung
    assert stuck.status_code == 503 and stuck.headers["content-type"].startswith("application/problem+json")
    assert stuck.json()["type"].endswith("/backend_error")
    rows = chained_rows(served, ("fallback", "stuck"))
    by_pipeline = {row["pipeline"]: row for row in rows}
    route = by_pipeline["fallback"]["route"]
    route = json.loads(route) if isinstance(route, str) else route
    assert route["fallbacks_tried"][0]["model"] == "hung" and route["fallbacks_tried"][0]["error"] == "backend_error"
    assert (by_pipeline["fallback"]["status"], by_pipeline["stuck"]["status"]) == ("ok", "failed")


async def test_clients_leaving_at_random_points_free_the_kv_cache(served):
    rng = random.Random(13)
    bodies = [{"input": f"Disconnect test {i}: describe the sea in a few sentences.", "max_tokens": 48}
              for i in range(24)]

    async def one(client: httpx.AsyncClient, body: dict) -> Reply:
        how = rng.choice(["lines", "lines", "cancel"])
        if how == "lines":
            return await post_stream(client, "/pipelines/chat", body, leave_after_lines=rng.randint(0, 60))
        task = asyncio.create_task(post_stream(client, "/pipelines/chat", body))
        await asyncio.sleep(rng.uniform(0.0, 3.0))
        task.cancel()  # mid-request: before the headers, or mid-stream
        try:
            return await task
        except asyncio.CancelledError:
            return Reply(body["input"], left_early=True)

    async with served.client() as client:
        replies = list(await asyncio.gather(*(one(client, body) for body in bodies)))
    assert sum(r.left_early for r in replies) >= len(replies) // 2
    stats = await wait_idle(served)
    assert (stats["running"], stats["waiting"], stats["kv_usage"]) == (0, 0, 0.0)
    async with served.client(served.auditor) as client:
        text = (await client.get("/metrics")).text
    gauges = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name in ("inferline_kv_cache_usage_perc", "inferline_num_requests_running")}
    assert gauges == {"inferline_kv_cache_usage_perc": 0.0, "inferline_num_requests_running": 0.0}
    rows = records_for(served, replies)
    counts = records_by_input(rows)
    assert max(counts.values(), default=1) == 1  # never twice
    accepted = [r for r in replies if r.status == 200]
    assert all(counts[sha256(r.input)] == 1 for r in accepted)  # every request that got its 200 is recorded
    assert {row["status"] for row in rows} <= {"ok", "disconnected"}
    assert any(row["status"] == "disconnected" for row in rows)


async def test_hostile_bodies_against_the_real_engine_are_4xx_and_the_server_stays_up(served):
    deep_schema = {"type": "array", "items": {}}
    for _ in range(300):
        deep_schema = {"type": "array", "items": deep_schema}
    bodies = {
        "past the context window": ({"input": "word " * 12_000}, (400,)),
        "past the context window, streamed": ({"input": "word " * 12_000, "stream": True}, (400,)),
        "a regex that does not compile": ({"input": "x", "output": {"regex": "("}}, (400,)),
        "a schema nested 300 deep": ({"input": "x", "max_tokens": 4, "output": {"json_schema": deep_schema}},
                                     (200, 400)),
        "max_tokens over the pipeline's limit": ({"input": "x", "max_tokens": 1_000_000}, (400,)),
    }
    async with served.client() as client:
        for name, (body, statuses) in bodies.items():
            response = await client.post("/pipelines/chat", json=body)
            assert response.status_code in statuses, (name, response.status_code, response.text[:300])
            if response.status_code != 200:
                assert response.headers["content-type"].startswith("application/problem+json"), name
        assert (await client.get("/healthz")).status_code == 200
        after = await post_stream(client, "/pipelines/chat", {"input": "Still there? Say yes.", "max_tokens": 4})
    assert after.done is not None


async def test_sigterm_under_load_drains_and_audits_every_accepted_request(served):
    replies: list[Reply] = []
    stop = asyncio.Event()

    async def client_loop(client: httpx.AsyncClient, n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            reply = await post_stream(client, "/pipelines/chat",
                                      {"input": f"SIGTERM test {n}.{i}: one fact about owls.", "max_tokens": 16})
            replies.append(reply)
            if reply.status != 200:
                return  # refused or unreachable: the server is going away

    async with served.client(timeout_s=120) as client:
        clients = [asyncio.create_task(client_loop(client, n)) for n in range(8)]
        while sum(r.done is not None for r in replies) < 8:
            await asyncio.sleep(0.2)
        served.server.terminate()
        code = await asyncio.to_thread(served.server.proc.wait, 120)
        stop.set()
        await asyncio.gather(*clients)
    assert code == 0, served.server.log_tail()
    accepted = [r for r in replies if r.status == 200]
    assert accepted and all(r.done is not None for r in accepted), [r for r in accepted if r.done is None][:3]
    counts = records_by_input(records_for(served, replies))
    assert all(counts[sha256(r.input)] == 1 for r in accepted)
    assert max(counts.values()) == 1
