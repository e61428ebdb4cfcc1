"""The load bench's short run: streaming clients against a real server, auth and audit on.

``bench/load.py`` itself runs (16 clients for 20 s of load here; ``make reliability`` runs 128 for
10 minutes), and its JSON line is checked for behaviour only: no server error, no 429 without
Retry-After, every request recorded once in the audit log. Its figures go to docs/reliability.md.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.server_process import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_short_load_run_serves_and_audits_every_request():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "load.py"), "--clients", "16", "--minutes", "0.33",
                          "--max-tokens", "32"], capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["requests_completed"] > 16, result
    assert (result["status_5xx"], result["status_429_without_retry_after"], result["stream_errors"],
            result["transport_errors"], result["other_4xx"]) == (0, 0, 0, 0, 0), result
    assert result["requests_completed"] + result["status_429_with_retry_after"] == result["requests_sent"]
    assert (result["audit_records"], result["audit_missing"], result["audit_duplicated"],
            result["audit_unmatched"]) == (result["requests_sent"], 0, 0, 0), result
    assert result["audit_verify_ok"] is True and result["server_exit_code"] == 0
