"""Refused calls in the audit log (serving/http/refusals.py): the real app, auth on, a real SQLite store.
(Every route's 401 and 403: tests/security/test_auth_matrix.py.)"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from serving.http.refusals import TokenBucket
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.engine import make_engine
from store.keys import KeyStore
from tests.serving.workspaces import write_workspace

#: A limit of one request a minute, in a pipeline without an audit stage and in one with.
LIMITED = """
name: {name}
access: {{roles: [caller]}}
stages:
  - {{id: guard, type: policy, with: {{limits: {{requests_per_minute: 1}}}}}}
  - {{id: prompt, type: prompt}}
  - {{id: tok, type: tokenize}}
  - {{id: gen, type: generate, with: {{max_tokens: 16, temperature: 0}}}}
  - {{id: out, type: stream}}
"""
AUDIT_STAGE = "  - {id: log, type: audit, always: true}\n"
A_KEY_THAT_DOES_NOT_EXIST = "il_AAAAAAAAAAAA_" + "b" * 43
TOO_LARGE = "x" * 5000  # http.max_body_bytes is 4096 in the test workspace


@dataclass
class Server:
    client: TestClient
    keys: dict[str, str]
    ids: dict[str, str]

    def auth(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"}

    def records(self, **filters: str) -> list[dict]:
        response = self.client.get("/audit/records", params={"limit": "500", **filters}, headers=self.auth("auditor"))
        assert response.status_code == 200, response.text
        return response.json()["records"]

    def dropped(self) -> dict[str, float]:
        text = self.client.get("/metrics", headers=self.auth("auditor")).text
        return {sample.labels["reason"]: sample.value for family in text_string_to_metric_families(text)
                if family.name == "inferline_audit_refusals_dropped" for sample in family.samples
                if sample.name.endswith("_total")}


@pytest.fixture
def server(tmp_path, monkeypatch, fake_engines):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=True)
    (tmp_path / "pipelines" / "limited.yaml").write_text(textwrap.dedent(LIMITED.format(name="limited")))
    (tmp_path / "pipelines" / "audited.yaml").write_text(
        textwrap.dedent(LIMITED.format(name="audited")) + AUDIT_STAGE)
    with TestClient(create_server(open_workspace(str(config)), engines=fake_engines)) as client:
        store = KeyStore(make_engine(f"sqlite:///{tmp_path / 'keys.db'}"))
        keys, ids = {}, {}
        for role in ("caller", "auditor"):
            info, keys[role] = store.create(f"the {role}", role)
            ids[role] = info.id
        client.app.state.inferline.services.refusals.clock = lambda: 1000.0  # no refill while a test runs
        yield Server(client, keys, ids)


def served_sha(server: Server, name: str) -> str:
    return server.client.app.state.inferline.services.executor.pipelines[name].loaded.sha256


def only(records: list[dict]) -> dict:
    assert len(records) == 1, records
    return records[0]


CHAT_BODY = {"input": "hi"}
OPENAI_BODY = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
#: Every route that calls a pipeline, with a body that names `chat`.
PIPELINE_CALLS = [("/pipelines/chat", CHAT_BODY), ("/v1/chat/completions", OPENAI_BODY),
                  ("/v1/completions", {"model": "chat", "prompt": "hi"}),
                  ("/v1/responses", {"model": "chat", "input": "hi"}),
                  ("/v1/messages", {**OPENAI_BODY, "max_tokens": 8}),
                  ("/v1/embeddings", {"model": "chat", "input": "hi"})]


@pytest.mark.parametrize("path, body", PIPELINE_CALLS)
@pytest.mark.parametrize("headers, code", [
    ({}, "missing_key"),
    ({"Authorization": "Bearer not-a-key"}, "invalid_key"),
    ({"Authorization": f"Bearer {A_KEY_THAT_DOES_NOT_EXIST}"}, "invalid_key"),
])
def test_a_401_leaves_one_record(server, path, body, headers, code):
    response = server.client.post(path, json=body, headers=headers)
    assert response.status_code == 401
    record = only(server.records(status="denied"))
    assert (record["http_status"], record["error_type"], record["key_id"], record["role"]) == (401, code, None, None)
    assert (record["pipeline"], record["spec_sha256"]) == ("chat", served_sha(server, "chat"))
    assert (record["input_content"], record["output_content"]) == ("", "")
    reason = only(record["policy"])
    assert (reason["stage"], reason["rule"], reason["category"], reason["route"]) == (
        "server", f"auth.{code}", "auth", path)
    # A well-formed key names which key was tried (its public id); the key itself is never kept.
    claimed = "AAAAAAAAAAAA" if A_KEY_THAT_DOES_NOT_EXIST in headers.get("Authorization", "") else None
    assert reason.get("claimed_key_id") == claimed
    assert "b" * 43 not in str(record) and "not-a-key" not in str(record)
    assert only(server.records(policy_category="auth"))["id"] == record["id"]


@pytest.mark.parametrize("path, body", PIPELINE_CALLS)
def test_an_auditors_403_on_a_caller_pipeline_leaves_one_record(server, path, body):
    response = server.client.post(path, json=body, headers=server.auth("auditor"))
    assert response.status_code == 403
    record = only(server.records(status="denied"))
    assert (record["http_status"], record["error_type"]) == (403, "role_not_allowed")
    assert (record["key_id"], record["role"]) == (server.ids["auditor"], "auditor")
    assert (record["pipeline"], record["spec_sha256"]) == ("chat", served_sha(server, "chat"))
    assert only(record["policy"])["rule"] == "auth.role"
    assert "may not call pipeline 'chat'" in record["policy"][0]["message"]


@pytest.mark.parametrize("path, body, pipeline", [
    ("/pipelines/chat", {"input": TOO_LARGE}, "chat"),
    ("/v1/chat/completions", {**OPENAI_BODY, "messages": [{"role": "user", "content": TOO_LARGE}]}, ""),
    ("/pipelines/no-such-pipeline", {"input": TOO_LARGE}, "no-such-pipeline"),
    ("/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
              "params": {"name": "chat", "arguments": {"input": TOO_LARGE}}}, ""),
])
def test_a_413_leaves_one_record_with_the_key_that_sent_it(server, path, body, pipeline):
    response = server.client.post(path, json=body, headers=server.auth("caller"))
    assert response.status_code == 413
    assert response.headers["content-type"].startswith(
        "application/json" if path.startswith("/v1/") else "application/problem+json")
    record = only(server.records(status="denied"))
    assert (record["http_status"], record["error_type"]) == (413, "body_too_large")
    assert (record["key_id"], record["role"]) == (server.ids["caller"], "caller")
    # The body was never read: the pipeline is the one the path names, served or not (the OpenAI routes
    # name theirs in the body).
    assert record["pipeline"] == pipeline
    assert record["spec_sha256"] == (served_sha(server, "chat") if pipeline == "chat" else "")
    assert only(record["policy"])["rule"] == "limits.max_body_bytes"


@pytest.mark.parametrize("stream", [False, True])
def test_a_429_in_a_pipeline_without_an_audit_stage_leaves_one_record(server, stream, fresh_minute):
    first = server.client.post("/pipelines/limited", json={"input": "hi"}, headers=server.auth("caller"))
    assert first.status_code == 200
    refused = server.client.post("/pipelines/limited", json={"input": "hi", "stream": stream},
                                 headers=server.auth("caller"))
    assert refused.status_code == 429
    record = only(server.records(pipeline="limited"))
    assert (record["status"], record["http_status"], record["error_type"]) == ("denied", 429, "rate_limit")
    assert (record["key_id"], record["role"]) == (server.ids["caller"], "caller")
    assert record["request_id"] == refused.json()["request_id"]
    assert record["spec_sha256"] == served_sha(server, "limited")
    assert only(record["policy"])["rule"] == "limits.requests_per_minute"


def test_a_429_that_the_audit_stage_recorded_is_not_recorded_twice(server, fresh_minute):
    for expected in (200, 429):
        response = server.client.post("/pipelines/audited", json={"input": "hi"}, headers=server.auth("caller"))
        assert response.status_code == expected
    denied = only(server.records(pipeline="audited", status="denied"))
    assert (denied["http_status"], denied["error_type"]) == (429, "rate_limited")
    assert only(denied["policy"])["stage"] == "guard"  # the stage's record, not the server's


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/audit/records", None),
    ("DELETE", "/pipelines/chat", None),  # a deploy route that names a pipeline: still no pipeline call
    ("POST", "/pipelines/chat/versions", {"yaml": "name: chat"}),
    ("GET", "/metrics", None),
])
def test_a_refusal_of_a_route_that_calls_no_pipeline_names_none(server, method, path, body):
    assert server.client.request(method, path, json=body).status_code == 401
    assert server.client.request(method, path, json=body, headers=server.auth("caller")).status_code == 403
    missing, forbidden = sorted(server.records(status="denied"), key=lambda r: r["seq"])
    assert (missing["http_status"], missing["error_type"], missing["key_id"]) == (401, "missing_key", None)
    assert (forbidden["http_status"], forbidden["error_type"]) == (403, "role_not_allowed")
    assert (forbidden["key_id"], forbidden["role"]) == (server.ids["caller"], "caller")  # identified off the path
    for record in (missing, forbidden):
        assert (record["pipeline"], record["spec_sha256"], record["pipeline_version"]) == ("", "", "")
        assert only(record["policy"])["route"] == path
    assert not server.records(pipeline="chat")


def test_a_hostile_path_is_recorded_printable(server):
    response = server.client.get("/pipelines/ch%00at/versions", headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401
    record = only(server.records(status="denied"))
    assert only(record["policy"])["route"] == "/pipelines/ch\\x00at/versions" and record["pipeline"] == ""


def test_the_consoles_refusals_name_the_key_of_its_cookie(server):
    stale = {"cookie": f"inferline_console_key={A_KEY_THAT_DOES_NOT_EXIST}"}
    assert server.client.get("/ui/api/metrics", headers=stale).status_code == 401
    assert server.client.get("/ui/audit", headers={"cookie": f"inferline_console_key={server.keys['caller']}"}
                             ).status_code == 403
    invalid, forbidden = sorted(server.records(status="denied"), key=lambda r: r["seq"])
    assert (invalid["error_type"], only(invalid["policy"])["claimed_key_id"]) == ("invalid_key", "AAAAAAAAAAAA")
    assert (forbidden["error_type"], forbidden["key_id"], only(forbidden["policy"])["route"]) == (
        "role_not_allowed", server.ids["caller"], "/ui/audit")


@pytest.mark.parametrize("method, path", [("POST", "/pipelines/chat"), ("GET", "/audit/records"),
                                          ("GET", "/pipelines/chat/versions")])
def test_a_flood_is_recorded_up_to_the_bound_and_counted_beyond_it(tmp_path, monkeypatch, fake_engines, method, path):
    monkeypatch.setenv("INFERLINE_AUDIT__REFUSALS__PER_CLIENT_PER_MINUTE", "3")
    monkeypatch.setenv("INFERLINE_AUDIT__REFUSALS__PER_MINUTE", "5")
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=True)
    with TestClient(create_server(open_workspace(str(config)), engines=fake_engines)) as client:
        client.app.state.inferline.services.refusals.clock = lambda: 1000.0
        _, auditor = KeyStore(make_engine(f"sqlite:///{tmp_path / 'keys.db'}")).create("reviewer", "auditor")
        server = Server(client, {"auditor": auditor}, {})
        body = CHAT_BODY if method == "POST" else None
        for _ in range(8):  # one client, one reason: 3 recorded (its own bucket), 5 counted
            response = client.request(method, path, json=body)
            assert response.status_code == 401 and response.json()["status"] == 401
        for _ in range(4):  # another reason has a bucket of its own, but only 2 tokens are left of 5 in all
            assert client.request(method, path, json=body, headers={
                "Authorization": "Bearer nope"}).status_code == 401
        records = server.records(status="denied")
        assert sorted(r["error_type"] for r in records) == ["invalid_key"] * 2 + ["missing_key"] * 3
        assert server.dropped() == {"missing_key": 5.0, "invalid_key": 2.0}
        verify = client.get("/audit/verify", headers=server.auth("auditor")).json()
        assert verify["ok"] and verify["checked"] == 5


def test_a_bucket_refills_at_its_rate_a_minute():
    bucket = TokenBucket(capacity=6, at=0.0)
    assert [bucket.take(0.0) for _ in range(7)] == [True] * 6 + [False]
    assert not bucket.take(9.0)  # 6 a minute: one every 10 s
    assert bucket.take(10.0) and not bucket.take(10.0)
    assert [bucket.take(1000.0) for _ in range(7)] == [True] * 6 + [False]  # never more than its capacity


def test_a_failure_to_record_never_turns_a_refusal_into_a_500(server, monkeypatch):
    refusals = server.client.app.state.inferline.services.refusals

    async def broken_write(record):
        raise RuntimeError("the sink is broken")

    monkeypatch.setattr(refusals.sink, "write", broken_write)
    response = server.client.post("/pipelines/chat", json=CHAT_BODY)
    assert response.status_code == 401 and response.json()["title"] == "Unauthorized"
    monkeypatch.setattr("serving.http.refusals._record", lambda *args: 1 / 0)
    response = server.client.post("/v1/chat/completions", json=OPENAI_BODY)
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
