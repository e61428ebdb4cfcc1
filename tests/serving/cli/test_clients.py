"""The tools and client packages people point at a server, unchanged, against a real ``inferline serve``.

One server with auth on (keys made with the real CLI) and one with auth off (loopback), both on the
bundled model: guidellm (vLLM's users' benchmark tool, run from its own virtual environment made by
``make test``, since its pins clash with ours).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.serving.cli.test_serve import ROOT, Server

pytestmark = [pytest.mark.slow, pytest.mark.integration]

GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("secured"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def caller_key(secured) -> str:
    return secured.key("caller")


def test_guidellm_streams_concurrently_with_no_error_and_exact_output_lengths(secured, caller_key, tmp_path):
    assert GUIDELLM.exists(), f"guidellm is not installed at {GUIDELLM}: run `make {GUIDELLM.relative_to(ROOT)}`"
    report = tmp_path / "guidellm.json"
    run = subprocess.run(
        [GUIDELLM, "run", "--backend", f"kind=openai_http,target={secured.url},model=chat,api_key={caller_key}",
         "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=8",
         "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=48",
         "--tokenizer", f"kind=hf_auto,model={ROOT / 'models' / 'smollm2-135m-instruct'}",
         "--output", f"kind=json,path={report}", "--disable-progress"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    requests = json.loads(report.read_text())["benchmarks"][0]["requests"]
    assert requests["errored"] == [] and requests["incomplete"] == []
    assert len(requests["successful"]) == 8
    # Streamed with continuous_usage_stats and ignore_eos: every request gets exactly its output tokens.
    assert [r["output_tokens"] for r in requests["successful"]] == [48] * 8
    body = json.loads(requests["successful"][0]["request_args"])["body"]
    assert body["ignore_eos"] is True and body["stream_options"]["continuous_usage_stats"] is True
