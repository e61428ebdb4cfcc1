"""A server killed between answering requests and chaining their audit records (SIGKILL, no shutdown):
the next start chains every one of them, once (the write-ahead journal, serving/backends/audit_sink.py)."""

from __future__ import annotations

import httpx
import pytest

from bench.server_process import ServerProcess
from tests.faults.replies import audit_rows, post_stream, records_by_input, sha256

pytestmark = [pytest.mark.slow, pytest.mark.integration]


async def test_records_answered_but_not_chained_when_the_server_dies_are_chained_at_the_next_start(tmp_path):
    db_url = f"sqlite:///{tmp_path}/server.db"
    server = ServerProcess.start(tmp_path, auth=False, settings={"plugins": ["tests.faults.audit_hold"]})
    try:
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=120) as client:
            replies = [await post_stream(client, "/pipelines/chat",
                                         {"input": f"Journal test {i}: name a bird.", "max_tokens": 4})
                       for i in range(3)]
        assert all(r.status == 200 and r.done is not None for r in replies), replies
        (journal,) = tmp_path.glob(f"audit-journal.{server.pid}-*.jsonl")
        assert len(journal.read_text().splitlines()) == 3  # durable before each answer...
        assert audit_rows(db_url, ["chat"]) == []  # ...and not chained yet
    finally:
        server.kill()  # no shutdown: nothing flushes
        server.stop()  # (only closes its log now)
    restarted = ServerProcess.start(tmp_path, auth=False)
    try:
        counts = records_by_input(audit_rows(db_url, ["chat"]))
        assert counts == {sha256(r.input): 1 for r in replies}
        assert not journal.exists()
        assert "left by a process that stopped" in restarted.log_tail()
        verified = httpx.get(f"{restarted.url}/audit/verify", trust_env=False).json()
        assert verified["ok"] is True, verified
    finally:
        assert restarted.stop() == 0, restarted.log_tail()
    assert not list(tmp_path.glob("audit-journal.*.jsonl"))  # the clean shutdown left none
