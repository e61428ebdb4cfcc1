"""The HTTP layer in-process, over fake engines: routes, SSE, errors, auth, metrics."""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import threading

import pytest
from litestar.testing import TestClient
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from pipeline.errors import Overloaded
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.audit import Journal
from tests.serving.workspaces import client_for, write_workspace


def sse_events(text: str) -> list[tuple[str, dict]]:
    events = []
    for block in text.replace("\r\n", "\n").strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            events.append((fields.get("event", "message"), json.loads(fields["data"])))
    return events


def test_json_answer(client):
    response = client.post("/pipelines/chat", json={"input": "Capital of France?"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["output"] == "Paris is the capital of France."
    assert body["finish_reason"] == "stop"
    assert body["usage"]["output_tokens"] == len(body["output"])
    assert [s["id"] for s in body["stages"]] == ["prompt", "tok", "gen", "out", "log"]
    assert all(set(s) >= {"id", "type", "status", "duration_ms", "cost_usd"} for s in body["stages"])
    assert body["cost_usd"] > 0 and len(body["trace_id"]) == 32
    assert response.headers["x-request-id"] == body["request_id"]


def test_sse_answer(client):
    response = client.post("/pipelines/chat", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "stage" and kinds[-1] == "done"
    assert "".join(data["text"] for kind, data in events if kind == "delta") == "Paris is the capital of France."
    assert events[-1][1]["usage"]["output_tokens"] > 0
    statuses = [(d["id"], d["status"]) for k, d in events if k == "stage"]
    assert statuses[:2] == [("prompt", "started"), ("prompt", "ok")]


def test_streamed_answers_take_no_worker_thread(client, monkeypatch):
    """A stream goes out from the event loop alone (Litestar's ServerSentEvent started each response
    with a step in a worker thread), with the same headers on both APIs. The audit journal's append
    (an fsync) is the one hop on a response's path, once per batch of records (serving/backends/audit_sink.py), not
    per response; its truncate once all is chained is another, after the answers."""
    handed = []
    real = asyncio.BaseEventLoop.run_in_executor

    def recording(loop, executor, func, *args):
        # asyncio.to_thread hands over partial(context.run, function, *args)
        target = func.args[0] if isinstance(func, functools.partial) and func.args else func
        if getattr(target, "__func__", None) not in (Journal.append, Journal.truncate):
            handed.append(func)
        return real(loop, executor, func, *args)

    monkeypatch.setattr(asyncio.BaseEventLoop, "run_in_executor", recording)
    response = client.post("/pipelines/chat", json={"input": "hi", "stream": True})
    assert sse_events(response.text)[-1][0] == "done"
    chunks = client.post("/v1/chat/completions", json={"model": "chat", "stream": True,
                                                       "messages": [{"role": "user", "content": "x"}]})
    assert chunks.text.rstrip().endswith("data: [DONE]")
    assert handed == []
    assert response.headers["cache-control"] == chunks.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == chunks.headers["x-accel-buffering"] == "no"


def test_accept_header_selects_sse(client):
    response = client.post("/pipelines/chat", json={"input": "hi"}, headers={"Accept": "text/event-stream"})
    assert sse_events(response.text)[-1][0] == "done"


def test_describe_pipelines(client):
    listed = client.get("/pipelines").json()["pipelines"]
    assert sorted(p["name"] for p in listed) == ["chat", "reviews"]
    chat = client.get("/pipelines/chat").json()
    assert [s["type"] for s in chat["stages"]] == ["prompt", "tokenize", "generate", "stream", "audit"]
    assert chat["access"] == {"roles": ["caller"]}
    assert "input" in chat["input_schema"]["properties"]


@pytest.mark.parametrize(("kwargs", "status", "needle"), [
    ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "JSON is malformed"),
    ({"json": {"input": "x", "surprise": 1}}, 422, "surprise"),
    ({"json": {"input": "x", "temperature": 9}}, 422, "temperature"),
    ({"json": {"input": "x", "messages": [{"role": "user", "content": "y"}]}}, 422, "exactly one"),
    ({"json": {"messages": [{"role": "robot", "content": "y"}]}}, 422, "role"),
    ({"json": {"input": "x" * 10_000}}, 413, ""),
    ({"json": {"input": "x", "max_tokens": 65}}, 400, "over this pipeline's limit"),
])
def test_bad_requests_get_problem_details(client, kwargs, status, needle):
    response = client.post("/pipelines/chat", **kwargs)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["status"] == status and body["title"] and body["type"].startswith("https://")
    assert needle in json.dumps(body)


def test_unknown_pipeline_is_404(client):
    response = client.post("/pipelines/nope", json={"input": "x"})
    assert response.status_code == 404
    assert "no pipeline 'nope'" in response.json()["detail"]
    assert client.get("/nowhere").status_code == 404


def test_overload_is_429_with_retry_after(client, fake_engines):
    async def overloaded(prompt_ids, sampling, cache_salt="", *, hints=None):
        raise Overloaded("queue full", retry_after_s=2.0)

    fake_engines.engines["smol"].submit = overloaded
    response = client.post("/pipelines/chat", json={"input": "x"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert response.json()["type"].endswith("/overloaded")


def test_health_ready_metrics_schema(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["status"] == "ready"
    assert client.get("/health").status_code == 200 and client.get("/health").json() == {}  # as vLLM answers
    assert client.get("/version").json()["version"]
    client.post("/pipelines/chat", json={"input": "x"})
    text = client.get("/metrics").text
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {"inferline_pipeline_requests", "inferline_stage_duration_seconds", "inferline_pipeline_cost_usd",
            "inferline_stage_runs"} <= names
    schema = client.get("/schema/openapi.json").json()
    assert {"/pipelines/{name}", "/v1/chat/completions", "/v1/models", "/metrics"} <= set(schema["paths"])


def test_openai_errors_use_openai_shape(client):
    response = client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user",
                                                                                       "content": "x"}]})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_openai_chat_json_and_stream(client, fake_engines):
    request = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
    body = client.post("/v1/chat/completions", json=request).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "Paris is the capital of France."
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    streamed = client.post("/v1/chat/completions", json={**request, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    lines = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Paris is the capital of France."
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    # vLLM's extensions, as guidellm sends them: the usage so far in every chunk; ignore_eos and
    # min_tokens handed to the engine.
    continuous = client.post("/v1/chat/completions", json={
        **request, "stream": True, "ignore_eos": True, "max_tokens": 40,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert continuous.status_code == 200, continuous.text
    chunks = openai_chunks(continuous.text)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 31  # one token per byte of the fake reply
    assert fake_engines.engines["smol"].submitted[-1][1].ignore_eos is True  # handed to the engine
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in chunks)
    taken = client.post("/v1/chat/completions", json={**request, "min_tokens": 4})
    assert taken.status_code == 200 and fake_engines.engines["smol"].submitted[-1][1].min_tokens == 4
    over = client.post("/v1/chat/completions", json={**request, "min_tokens": 50, "max_tokens": 40})
    assert over.status_code == 400 and "min_tokens" in over.json()["error"]["message"], over.text
    # A parameter is refused by name, never ignored; what we take (user, parallel_tool_calls) is taken.
    for extra, param in (({"logit_bias": {"1": 5}}, "logit_bias"), ({"top_logprobs": 2}, "top_logprobs"),
                         ({"bogus": 1}, "bogus")):  # top_logprobs without logprobs: true
        refused = client.post("/v1/chat/completions", json={**request, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    taken = client.post("/v1/chat/completions", json={**request, "user": "alice", "parallel_tool_calls": False,
                                                      "logprobs": False})
    assert taken.status_code == 200, taken.text


#: What the rag pipeline's answer reports over the fake handbook index: both passages, numbered as cited.
SOURCES = [{"n": 1, "citation": "[1]", "id": "billing#3", "title": "Billing", "path": "billing.md", "score": 0.81},
           {"n": 2, "citation": "[2]", "id": "refunds#9", "title": "Refunds", "path": "refunds.md", "score": 0.42}]


def openai_chunks(text: str) -> list[dict]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_rag_answer_carries_its_sources_in_json_and_sse(rag_client, fake_engines):
    body = rag_client.post("/pipelines/rag", json={"input": "How much is Plus?"}).json()
    assert body["sources"] == SOURCES
    prompt = bytes(fake_engines.engines["smol"].submitted[-1][0]).decode()
    assert "[1] Billing (billing.md)\nPlus costs $8." in prompt and "[2] Refunds (refunds.md)" in prompt
    streamed = rag_client.post("/pipelines/rag", json={"input": "How much is Plus?", "stream": True})
    kind, done = sse_events(streamed.text)[-1]
    assert kind == "done" and done["sources"] == SOURCES


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "How much is Plus?"}]}),
    ("/v1/completions", {"prompt": "How much is Plus?"}),
])
def test_a_rag_answer_carries_its_sources_in_openai_responses(rag_client, path, body):
    plain = rag_client.post(path, json={"model": "rag", **body}).json()
    assert plain["sources"] == SOURCES
    streamed = rag_client.post(path, json={"model": "rag", **body, "stream": True,
                                           "stream_options": {"include_usage": True}})
    chunks = openai_chunks(streamed.text)
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["sources"] == SOURCES
    assert all("sources" not in c for c in chunks if c is not final[0])  # once, on the chunk that ends the answer
    client = OpenAI(base_url=f"{rag_client.base_url}/v1", api_key="unused", http_client=rag_client)
    answer = (client.chat.completions.create(model="rag", **body) if "messages" in body
              else client.completions.create(model="rag", **body))
    assert answer.model_extra["sources"] == SOURCES  # what docs/api.md tells openai package users to read


def test_an_answer_without_retrieval_has_no_sources(client):
    assert client.post("/pipelines/chat", json={"input": "x"}).json()["sources"] == []
    request = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
    assert client.post("/v1/chat/completions", json=request).json()["sources"] == []
    chunks = openai_chunks(client.post("/v1/chat/completions", json={**request, "stream": True}).text)
    assert chunks[-1]["sources"] == []


def test_auth_matrix(auth_client, keys):
    _, caller = keys.create("app", "caller")
    _, auditor = keys.create("reviewer", "auditor")
    _, admin = keys.create("ops", "admin")
    info, revoked = keys.create("old", "caller")
    keys.revoke(info.id)

    def call(key, pipeline="chat"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return auth_client.post(f"/pipelines/{pipeline}", json={"input": "x"}, headers=headers).status_code

    assert call(None) == 401
    assert call("il_nope_nope") == 401
    assert call(revoked) == 401
    assert call(caller) == 200
    assert call(auditor) == 403  # an auditor cannot call a caller-only pipeline
    assert call(auditor, "reviews") == 200
    assert call(caller, "reviews") == 403
    assert call(admin) == 200
    assert auth_client.get("/metrics", headers={"Authorization": f"Bearer {caller}"}).status_code == 403
    assert auth_client.get("/metrics", headers={"Authorization": f"Bearer {auditor}"}).status_code == 200
    assert auth_client.get("/healthz").status_code == 200


def test_auth_off_refuses_a_public_address(tmp_path, monkeypatch):
    from pipeline.errors import SpecError

    monkeypatch.setenv("INFERLINE_HOST", "0.0.0.0")
    workspace = open_workspace(str(write_workspace(tmp_path, auth=False)))
    with pytest.raises(SpecError, match=r"auth is off, so binding 0\.0\.0\.0 is refused"):
        create_server(workspace)


def test_invalid_pipeline_refuses_to_start(tmp_path, monkeypatch):
    from pipeline.errors import SpecError

    config = write_workspace(tmp_path, auth=False)
    (tmp_path / "pipelines" / "broken.yaml").write_text("name: broken\nstages: [{id: a, type: nope}]\n")
    (tmp_path / "pipelines" / "broken2.yaml").write_text("name: chat\nstages: [{id: a, type: prompt}]\n")
    with pytest.raises(SpecError) as info:
        create_server(open_workspace(str(config)))
    text = str(info.value)
    assert "broken.yaml:2:24: stages[0].type: unknown stage type 'nope'" in text
    assert f"name: pipeline name 'chat' is already used by {tmp_path / 'pipelines' / 'broken2.yaml'}:1:7;" in text


def test_the_app_leaves_logging_to_the_process(tmp_path, monkeypatch, fake_engines):
    """`inferline serve --log-level warning` configures the root logger; building the app keeps it so
    (Litestar's default config reset it to INFO and started a queue thread per app)."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.WARNING)
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    handlers, threads = list(root.handlers), set(threading.enumerate())
    client_for(tmp_path, monkeypatch, fake_engines, auth=False)  # builds the app, starts nothing
    assert root.level == logging.WARNING and root.handlers == handlers
    assert not set(threading.enumerate()) - threads


def test_a_serving_app_freezes_its_heap_while_it_runs(tmp_path, monkeypatch, fake_engines):
    """``freeze_heap`` (inferline serve, the Ray ingress): what the started app holds is out of the
    collector's sight until shutdown, and given back then."""
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    workspace = open_workspace(str(write_workspace(tmp_path, auth=False)))
    app = create_server(workspace, engines=fake_engines, freeze_heap=True)
    assert gc.get_freeze_count() == 0
    with TestClient(app) as test_client:
        assert gc.get_freeze_count() > 0
        assert test_client.get("/readyz").status_code == 200
    assert gc.get_freeze_count() == 0
    with TestClient(create_server(workspace, engines=fake_engines)):  # the default: tests, embedding
        assert gc.get_freeze_count() == 0
