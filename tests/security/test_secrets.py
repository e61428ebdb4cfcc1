"""Secrets stay secret: API keys never reach logs, traces, audit records or error bodies; prompts and
answers never reach logs above DEBUG; audit filters are data, never SQL; and the server's secrets can
come from environment variables or files instead of inferline.yaml.
"""

from __future__ import annotations

import json
import logging
import textwrap

import pytest
import sqlalchemy as sa
from litestar.testing import TestClient
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline import tracing
from serving.console.state import STATE_KEY
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.engine import make_engine
from store.keys import KeyStore
from tests.fakes import FakeEngine, FakeEngines
from tests.security.secured_app import ANSWER, App, make_workspace

PROMPT = "Zanzibar-prompt-4471: what is the capital of France?"


def key_secrets(keys: dict[str, str]) -> list[str]:
    """What must never be written anywhere: each whole key, and its secret part alone
    (``il_<id>_<secret>``; the secret itself may hold underscores)."""
    return [*keys.values(), *(key.split("_", 2)[2] for key in keys.values())]


def test_keys_and_prompts_stay_out_of_logs_traces_audit_and_error_bodies(tmp_path, monkeypatch, caplog):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_AUTH__ENABLED"):
        monkeypatch.delenv(name, raising=False)
    config = make_workspace(tmp_path)
    exported = InMemorySpanExporter()  # every span the app makes, as an exporter would send it
    monkeypatch.setattr(tracing, "_processor", lambda exporter, endpoint: SimpleSpanProcessor(exported))
    db_url = f"sqlite:///{tmp_path / 'server.db'}"
    caplog.set_level(logging.DEBUG)
    bodies: list[str] = []
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine(ANSWER)))
    with TestClient(app, raise_server_exceptions=False) as client:
        store = KeyStore(make_engine(db_url))
        keys = {role: store.create(f"leak-{role}", role)[1] for role in ("caller", "auditor", "admin")}
        revoked_info, revoked = store.create("leak-revoked", "caller")
        store.revoke(revoked_info.id)
        keys["revoked"] = revoked
        unknown = keys["caller"][:16] + "B" * 43
        keys["unknown"] = unknown

        def call(method: str, path: str, key: str | None, **kwargs) -> None:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = client.request(method, path, headers={**headers, **kwargs.pop("headers", {})}, **kwargs)
            bodies.append(f"{response.status_code} {dict(response.headers)} {response.text}")

        chat = {"input": PROMPT}
        call("POST", "/pipelines/chat", keys["caller"], json=chat)                       # served
        call("POST", "/pipelines/chat", keys["caller"], json={**chat, "stream": True})   # streamed
        call("POST", "/pipelines/chat", keys["auditor"], json=chat)                      # 403
        call("POST", "/pipelines/chat", revoked, json=chat)                              # 401 revoked
        call("POST", "/pipelines/chat", unknown, json=chat)                              # 401 unknown
        call("POST", "/pipelines/chat", keys["caller"], json={**chat, "temperature": 9})  # 422
        call("POST", "/pipelines/chat", keys["caller"], json={**chat, "max_tokens": 65})  # 400
        call("POST", "/pipelines/nope", keys["caller"], json=chat)                       # 404
        call("POST", "/v1/chat/completions", keys["caller"], json={"model": "chat", "messages": [
            {"role": "user", "content": PROMPT}]})
        call("POST", "/v1/chat/completions", revoked, json={"model": "chat", "messages": []})
        call("GET", "/audit/records", keys["auditor"], params={"text": "Zanzibar"})
        call("GET", "/audit/records", keys["caller"])                                    # 403
        call("GET", "/metrics", keys["admin"])
        call("POST", "/ui/login", None, data={"api_key": keys["caller"], "csrf_token": "wrong"})  # refused
        call("POST", "/ui/login", None, data={"api_key": revoked})
        ring = repr(app.state[STATE_KEY].ring.recent(1000))
    traces = "\n".join(span.to_json() for span in exported.get_finished_spans())
    with make_engine(db_url).connect() as conn:
        audit = json.dumps([dict(row) for row in conn.execute(sa.text("SELECT * FROM audit_records")).mappings()]
                           + [dict(row) for row in conn.execute(sa.text("SELECT * FROM audit_stages")).mappings()]
                           + [dict(row) for row in conn.execute(sa.text("SELECT * FROM audit_access_log")).mappings()],
                           default=str)
    assert "Zanzibar" in audit and '"trace_id"' in traces  # the places searched do hold the requests
    # The server's logs, not the test client's: httpx logs each request it sends, with its URL (one of
    # them asks the audit API for "Zanzibar"), at INFO.
    logs = [(record.levelno, record.getMessage() + (record.exc_text or "")) for record in caplog.records
            if "http://testserver.local" not in record.getMessage()]
    assert any(record.name.startswith("serving.") for record in caplog.records)  # the server's logs were captured
    places = {"logs": "\n".join(text for _, text in logs), "traces": traces, "console traces": ring,
              "audit records": audit, "responses": "\n".join(bodies)}
    for secret in key_secrets(keys):
        for place, text in places.items():
            assert secret not in text, f"a key (or its secret) appears in the {place}"
    loud = "\n".join(text for level, text in logs if level >= logging.INFO)
    assert "Zanzibar" not in loud and ANSWER not in loud  # prompts and answers: DEBUG at most


@pytest.fixture(scope="module")
def with_records(secured: App) -> App:
    for text in ("alpha question", "beta question", "it's a quote's test", "100% sure"):
        response = secured.client.post("/pipelines/chat", json={"input": text}, headers=secured.auth("caller"))
        assert response.status_code == 200
    return secured


INJECTIONS = ["' OR '1'='1", "chat' OR 1=1 --", "chat\"; DROP TABLE audit_records; --", "%", "_", "%%", "\\",
              "chat' UNION SELECT id, hash FROM api_keys --", "'; DELETE FROM audit_records WHERE '1'='1",
              "\x00", "chat\x00' OR '1'='1", "1) OR (1=1", "*", "chat%", "' || (SELECT secret_hash FROM api_keys) || '"]
FILTERS = ["pipeline", "spec_sha256", "key_id", "model", "policy_action", "policy_category", "status",
           "finish_reason", "text", "sort", "cursor", "since", "min_cost_usd"]


def audit_state(app: App) -> tuple[int, int, int]:
    with make_engine(app.db_url).connect() as conn:
        return tuple(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()  # type: ignore[return-value]
                     for table in ("audit_records", "api_keys", "audit_stages"))


@pytest.mark.parametrize("name", FILTERS)
def test_audit_filters_are_data_not_sql(with_records, name):
    auditor = with_records.auth("auditor")
    # An API read first: it waits until the server has chained every answered request's record (they go
    # through its journal), so the tables read below hold them all.
    total = len(with_records.client.get("/audit/records", params={"limit": 500}, headers=auditor).json()["records"])
    before = audit_state(with_records)
    for value in INJECTIONS:
        for path in ("/audit/records", "/audit/summary", "/audit/export"):
            response = with_records.client.get(path, params={name: value}, headers=auditor)
            assert response.status_code in (200, 400, 422), (path, name, value, response.status_code, response.text)
            if response.status_code != 200:
                assert response.headers["content-type"].startswith("application/problem+json")
        response = with_records.client.get("/audit/records", params={name: value, "limit": 500}, headers=auditor)
        if response.status_code != 200:
            continue
        found = response.json()["records"]
        assert "secret_hash" not in response.text
        if name == "text":  # a substring search: only records whose content holds the text literally
            assert all(value in record["input_content"] + record["output_content"] for record in found), value
        elif name not in ("sort", "cursor", "since", "min_cost_usd"):
            assert found == [], (name, value)  # an exact-match filter matches nothing here
        else:
            assert len(found) <= total
    assert audit_state(with_records) == before  # nothing deleted, nothing added
    assert with_records.client.get("/audit/verify", headers=auditor).json()["ok"] is True


def test_the_text_filter_treats_wildcards_literally(with_records):
    auditor = with_records.auth("auditor")
    hits = {value: with_records.client.get("/audit/records", params={"text": value, "limit": 500},
                                           headers=auditor).json()["records"] for value in ("%", "_", "'s", "100%")}
    assert hits["%"] == hits["100%"] and len(hits["100%"]) == 1  # only the record that says "100%"
    assert hits["_"] == []
    assert len(hits["'s"]) == 1


def test_secrets_come_from_the_environment_or_files(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_AUTH__ENABLED"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "inferline.yaml"
    config.write_text(textwrap.dedent("""
        models:
          remote: {backend: openai, base_url: "http://127.0.0.1:9/v1", remote_model: m, api_key_env: REMOTE_KEY}
        database: sqlite:///placeholder.db
        auth: {enabled: true}
        """))
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "db-url").write_text("postgresql://inferline:s3cr3t-pw@127.0.0.1:5432/inferline\n")
    (secrets / "checkpoint-key").write_text("checkpoint-key-from-a-file\n")
    monkeypatch.setenv("INFERLINE_DATABASE_FILE", str(secrets / "db-url"))
    monkeypatch.setenv("INFERLINE_AUDIT__CHECKPOINT_KEY_FILE", str(secrets / "checkpoint-key"))
    monkeypatch.setenv("INFERLINE_AUDIT__MODE", "required")
    server = open_workspace(str(config)).server
    assert server.database == "postgresql://inferline:s3cr3t-pw@127.0.0.1:5432/inferline"
    assert server.audit.checkpoint_key == "checkpoint-key-from-a-file"
    assert server.audit.mode == "required"
    assert "s3cr3t" not in config.read_text() and "checkpoint-key" not in config.read_text()
    # A remote backend's key is named by the variable that holds it, never written in the YAML (that it
    # is read from there per request: tests/serving/backends/test_remote.py).
    assert server.models["remote"].api_key_env == "REMOTE_KEY"
    monkeypatch.setenv("INFERLINE_AUDIT__CHECKPOINT_KEY", "from-the-environment")
    monkeypatch.delenv("INFERLINE_AUDIT__CHECKPOINT_KEY_FILE")
    assert open_workspace(str(config)).server.audit.checkpoint_key == "from-the-environment"


def test_a_missing_secret_file_is_a_located_error_that_does_not_echo_secrets(tmp_path, monkeypatch):
    from pipeline.errors import SpecError

    config = tmp_path / "inferline.yaml"
    config.write_text("database: sqlite:///x.db\n")
    monkeypatch.setenv("INFERLINE_DATABASE_FILE", str(tmp_path / "missing"))
    with pytest.raises(SpecError) as raised:
        open_workspace(str(config))
    assert str(raised.value).startswith("INFERLINE_DATABASE_FILE:1:1: cannot read")
