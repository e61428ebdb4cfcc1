"""content: encrypted through a real server: the content is encrypted at rest and read back decrypted
by a reviewer (the API, the CLI, the console, each read logged); after ``inferline audit erase`` it is
unreadable everywhere, the chain verifies and the erasure is on record; a held record refuses; a wrong
master key stops the server at start."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess

import pytest
import sqlalchemy as sa
from litestar.testing import TestClient
from sqlalchemy.engine import make_url

from pipeline.errors import SpecError
from serving.cli.main import main
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.engine import make_engine
from store.keys import KeyStore
from store.migrate import create_schema
from tests.fakes import FakeEngine, FakeEngines
from tests.postgres import fresh_schema_url
from tests.serving.console.signin import sign_in
from tests.serving.workspaces import CHAT, write_workspace

MASTER = base64.b64encode(os.urandom(32)).decode()


def encrypted_workspace(tmp_path, monkeypatch, database: str | None = None):
    """The test workspace with content encrypted per ``tags.user``, on its SQLite file or on *database*."""
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_AUDIT__MASTER_KEY"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=True)
    (tmp_path / "pipelines" / "chat.yaml").write_text(
        CHAT.replace("with: {content: full}", "with: {content: encrypted, subject: tags.user}"))
    monkeypatch.setenv("INFERLINE_AUDIT__MASTER_KEY", MASTER)
    if database is not None:
        monkeypatch.setenv("INFERLINE_DATABASE", database)
    engine = make_engine(database or f"sqlite:///{tmp_path / 'keys.db'}")
    create_schema(engine)
    keys = KeyStore(engine)
    return config, engine, keys.create("app", "caller")[1], keys.create("review", "auditor")[1]


def test_encrypted_content_is_read_decrypted_until_erased(tmp_path, monkeypatch, capsys):
    config, engine, caller, auditor = encrypted_workspace(tmp_path, monkeypatch)
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))
    as_caller, as_auditor = ({"Authorization": f"Bearer {key}"} for key in (caller, auditor))
    with TestClient(app) as client:
        for user in ("alice", "bob", "alice"):
            assert client.post("/pipelines/chat", headers=as_caller,
                               json={"input": f"{user}'s secret question", "tags": {"user": user}}).status_code == 200
        assert len(client.get("/audit/records", headers=as_auditor).json()["records"]) == 3  # all chained now
        with engine.connect() as conn:
            stored = conn.execute(sa.text("SELECT id, content_mode, input_content FROM audit_records "
                                          "ORDER BY seq")).all()
        assert [mode for _, mode, _ in stored] == ["encrypted"] * 3
        assert not any("secret" in text for _, _, text in stored)  # not in the database...
        journals = list(tmp_path.glob("audit-journal*"))
        assert journals and not any(b"secret" in path.read_bytes() for path in journals)  # ...nor in the journal
        alice = stored[0][0]
        shown = client.get(f"/audit/records/{alice}", headers=as_auditor).json()
        assert shown["decrypted"] == {"input": "alice's secret question", "output": "Paris.", "tags": {"user": "alice"},
                                     "tools": []}
        assert shown["input_content"].startswith("enc:v1:")
        sign_in(client, auditor)
        assert "alice&#39;s secret question" in client.get(f"/ui/audit/records/{alice}").text
        actions = [e["action"] for e in client.get("/audit/access", headers=as_auditor).json()["entries"]]
        assert actions.count("decrypt") == 2

        assert main(["audit", "erase", "--subject", "tags.user:alice", "--by", "dpo", "--config", str(config)]) == 0
        assert "the content of 2 record(s) can no longer be read" in capsys.readouterr().out
        shown = client.get(f"/audit/records/{alice}", headers=as_auditor).json()
        assert shown["content_erased"] is True and shown["decrypted"] is None
        assert 'id="content-erased"' in client.get(f"/ui/audit/records/{alice}").text
        bob = client.get(f"/audit/records/{stored[1][0]}", headers=as_auditor).json()
        assert bob["decrypted"]["input"] == "bob's secret question"
        assert client.get("/audit/verify", headers=as_auditor).json()["ok"] is True
        erasures = [p for r in client.get("/audit/records", headers=as_auditor).json()["records"]
                    for p in r.get("policy") or [] if p.get("where") == "erase"]
        assert len(erasures) == 1 and "by dpo" in erasures[0]["message"]
    assert main(["audit", "show", alice, "--config", str(config)]) == 0
    assert json.loads(capsys.readouterr().out)["content_erased"] is True
    assert main(["audit", "verify", "--config", str(config)]) == 0


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def test_after_erasure_the_subjects_name_is_nowhere_in_the_database(tmp_path, monkeypatch, capsys, database):
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(fresh_schema_url()) if database == "postgresql" else None
        config, engine, caller, auditor = encrypted_workspace(tmp_path, monkeypatch, url)
        stack.callback(engine.dispose)
        as_caller, as_auditor = ({"Authorization": f"Bearer {key}"} for key in (caller, auditor))
        app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))
        with TestClient(app) as client:
            # Alice by each name a client can give her: the user tag, OpenAI's user, Anthropic's user_id.
            assert client.post("/pipelines/chat", headers=as_caller, json={
                "input": "a question", "tags": {"user": "alice", "tier": "gold"}}).status_code == 200
            assert client.post("/v1/chat/completions", headers=as_caller, json={
                "model": "chat", "user": "alice", "messages": [{"role": "user", "content": "q"}]}).status_code == 200
            assert client.post("/v1/messages", headers=as_caller, json={
                "model": "chat", "max_tokens": 16, "metadata": {"user_id": "alice"},
                "messages": [{"role": "user", "content": "q"}]}).status_code == 200
            assert client.post("/pipelines/chat", headers=as_caller,
                               json={"input": "q", "tags": {"user": "bob"}}).status_code == 200
            found = client.get("/audit/records", headers=as_auditor, params={"subject": "tags.user:alice"}).json()
            assert len(found["records"]) == 3 and all(r["tags"].startswith("enc:v1:") for r in found["records"])
            shown = client.get(f"/audit/records/{found['records'][-1]['id']}", headers=as_auditor).json()
            assert shown["decrypted"]["tags"] == {"user": "alice", "tier": "gold"}
        assert main(["audit", "query", "--subject", "tags.user:alice", "--format", "jsonl",
                     "--config", str(config)]) == 0
        assert len(capsys.readouterr().out.splitlines()) == 3
        assert main(["audit", "erase", "--subject", "tags.user:alice", "--by", "dpo", "--config", str(config)]) == 0
        assert "the content of 3 record(s) can no longer be read" in capsys.readouterr().out
        assert main(["audit", "verify", "--config", str(config)]) == 0
        assert capsys.readouterr().out.startswith("ok: 5 record(s) checked")  # four requests and the erasure
        engine.dispose()
        stored = pg_dump(url) if url else b"".join(path.read_bytes() for path in tmp_path.glob("keys.db*"))
        assert b"dpo" in stored  # who erased is kept in clear: the search does see what is there
        assert b"alice" not in stored and b"gold" not in stored  # her name, and her other tags
        assert not any(b"alice" in path.read_bytes() for path in tmp_path.glob("audit-journal*"))


def pg_dump(url: str) -> bytes:
    """Every row of the test's schema, as pg_dump writes it."""
    parsed = make_url(url)
    schema = parsed.query["options"].removeprefix("-csearch_path=")
    return subprocess.run(["pg_dump", "--host", parsed.host or "", "--port", str(parsed.port or 5432),
                           "--username", parsed.username or "", "--schema", schema, "--no-password",
                           parsed.database or ""], check=True, capture_output=True, timeout=60).stdout


def test_a_held_record_refuses_erasure_and_a_wrong_master_key_stops_the_server(tmp_path, monkeypatch, capsys):
    config, _, caller, _ = encrypted_workspace(tmp_path, monkeypatch)
    with TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))) \
            as client:
        assert client.post("/pipelines/chat", headers={"Authorization": f"Bearer {caller}"},
                           json={"input": "q", "tags": {"user": "carol"}}).status_code == 200
    assert main(["audit", "hold", "--pipeline", "chat", "--config", str(config)]) == 0
    capsys.readouterr()
    assert main(["audit", "erase", "--subject", "tags.user:carol", "--config", str(config)]) == 1
    assert "legal hold" in capsys.readouterr().err
    monkeypatch.setenv("INFERLINE_AUDIT__MASTER_KEY", base64.b64encode(os.urandom(32)).decode())
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine()))
    with pytest.raises(ExceptionGroup) as caught, TestClient(app):  # the lifespan opens the database, with its keys
        pass
    assert caught.group_contains(SpecError, match="does not unwrap the audit data keys")
