"""The four workflow examples (triage, research, draft_check, escalate) as a client meets them: a real
``inferline serve`` on the bundled model and the shipped pipelines folder, auth on, over JSON, server-sent
events and the official ``openai`` package; the audit record keeps each step (60, "How it is checked")."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.serving.cli.test_serve import Server

pytestmark = [pytest.mark.slow, pytest.mark.integration]

QUESTIONS = {
    "triage": "The app crashes every time I open the settings page.",
    "research": "How much storage does the Plus plan include now?",
    "draft_check": "Can I get my money back for last month?",
    "escalate": "The app crashes when I open a board.",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("workflows"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def keys(server) -> dict[str, str]:
    return {role: server.key(role) for role in ("caller", "auditor")}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("name", sorted(QUESTIONS))
def test_each_example_answers_over_json_and_records_its_steps(server, keys, name):
    answer = httpx.post(f"{server.url}/pipelines/{name}", json={"input": QUESTIONS[name]},
                        headers=bearer(keys["caller"]), timeout=300)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["output"].strip() and body["usage"]["output_tokens"] > 0
    statuses = {stage["id"]: stage["status"] for stage in body["stages"]}
    assert "error" not in statuses.values(), body["stages"]
    if name == "triage":  # one branch ran, the others are skipped: which is the model's call
        assert statuses["classify"] == "ok"
        assert sum(statuses[branch] == "ok" for branch in ("escalate", "refund", "tech", "other")) == 1
        assert sum(statuses[branch] == "skipped" for branch in ("escalate", "refund", "tech", "other")) == 3
    records = httpx.get(f"{server.url}/audit/records", params={"pipeline": name, "limit": 1},
                        headers=bearer(keys["auditor"]), timeout=30).json()["records"]
    if name != "research":  # research keeps no audit stage of its own
        record = httpx.get(f"{server.url}/audit/records/{records[0]['id']}", headers=bearer(keys["auditor"]),
                           timeout=30).json()
        assert record["request_id"] == body["request_id"]
        kept = {stage["stage_id"]: stage for stage in record["stages"]}
        ran = {stage["id"] for stage in body["stages"] if stage["status"] == "ok" and stage["type"] != "audit"}
        assert set(kept) >= ran  # the audit step writes the record: it is not in it
        assert all(kept[s]["step"] for s in ran if kept[s]["type"] == "llm")


def test_triage_streams_its_branch_over_sse(server, keys):
    with httpx.stream("POST", f"{server.url}/pipelines/triage", json={"input": QUESTIONS["triage"], "stream": True},
                      headers=bearer(keys["caller"]), timeout=300) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    blocks = [block for block in text.replace("\r\n", "\n").split("\n\n") if block.strip()]
    assert blocks[-1].startswith("event: done"), blocks[-1]
    done = json.loads(blocks[-1].split("data: ", 1)[1])
    deltas = "".join(json.loads(block.split("data: ", 1)[1])["text"] for block in blocks
                     if block.startswith("event: delta"))
    assert deltas == done["output"] and deltas.strip()


def test_the_openai_client_calls_a_workflow_by_name(server, keys):
    with OpenAI(base_url=f"{server.url}/v1", api_key=keys["caller"]) as client:
        plain = client.chat.completions.create(model="escalate", messages=[
            {"role": "user", "content": QUESTIONS["escalate"]}])
        assert plain.choices[0].message.content.strip() and plain.usage.completion_tokens > 0
        streamed = client.chat.completions.create(model="triage", stream=True, messages=[
            {"role": "user", "content": QUESTIONS["triage"]}])
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        assert text.strip()
