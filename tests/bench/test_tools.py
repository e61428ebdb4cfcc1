"""bench/tools.py gives every figure on a tiny run, its calls succeed, and its last line is one JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_a_tiny_run_gives_every_figure():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "tools.py"), "--quick", "--calls", "5", "--runs",
                           "1", "--tool-s", "0.05"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("tool_call_overhead_ms_p50", "tool_call_step_ms_p50", "tool_call_direct_ms_p50",
                "parallel_calls_speedup", "parallel_calls_ms_p50", "sequential_calls_ms_p50"):
        assert isinstance(result[key], float), key
    assert result["calls"] == 5 and result["runs"] == 1
    assert result["sequential_calls_ms_p50"] > result["parallel_calls_ms_p50"]  # 4 rounds of waits against 1
