"""Two real server processes share one Redis-backed rate limit (each has its own SQLite database)."""

from __future__ import annotations

import textwrap
import time

import httpx
import pytest

from tests.serving.cli.test_serve import Server

pytestmark = [pytest.mark.slow, pytest.mark.integration]

LIMITED = """
name: limited
stages:
  - {id: guard, type: policy, with: {limits: {requests_per_minute: 3, per: pipeline}}}
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 2, temperature: 0}}
  - {id: out, type: stream}
"""


def test_two_processes_share_one_redis_limit(tmp_path, redis_url, redis_prefix):
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "limited.yaml").write_text(textwrap.dedent(LIMITED))
    extra = f"limits: {{backend: redis, redis_url: '{redis_url}', prefix: {redis_prefix}}}\n"
    servers = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            servers.append(Server(tmp_path / name, auth=False, pipelines=tmp_path / "pipelines", extra=extra))
        a, b = servers

        def call(server: Server) -> httpx.Response:
            return httpx.post(f"{server.url}/pipelines/limited", json={"input": "Hi"}, timeout=60)

        left = 60 - time.time() % 60  # the five calls must fall in one one-minute window
        if left < 20:
            time.sleep(left + 0.05)
        answers = [call(a), call(b), call(a)]
        assert [r.status_code for r in answers] == [200, 200, 200]
        assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == ["2", "1", "0"]
        # Whichever process is asked, the shared limit is used up.
        refused = [call(b), call(a)]
        assert [r.status_code for r in refused] == [429, 429]
        assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    finally:
        for server in servers:
            server.stop()
