"""A server that signs its checkpoints with Ed25519 and delivers each as a digest file; a reviewer
who holds only the public key verifies the database against the digests (``inferline audit``). By
default the server signs with a key it makes beside its database; the newest records are anchored
within seconds, whoever wrote them, and verify names those not anchored yet."""

from __future__ import annotations

import os
import stat
import time
from datetime import UTC, datetime, timedelta

import pytest
from litestar.testing import TestClient

from pipeline.errors import SpecError
from serving.cli.main import main
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.audit import AuditStore
from store.engine import make_engine
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import write_workspace
from tests.store.audit.test_anchors import cut_tail


def test_keygen_writes_a_key_pair_once(tmp_path, capsys):
    key = tmp_path / "signing.pem"
    assert main(["audit", "keygen", "--out", str(key)]) == 0
    assert "key id" in capsys.readouterr().out
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600 and b"PUBLIC KEY" in (tmp_path / "signing.pem.pub").read_bytes()
    assert main(["audit", "keygen", "--out", str(key)]) == 1  # never overwritten
    assert "exists" in capsys.readouterr().err


def test_digests_are_delivered_and_verified_with_the_public_key(tmp_path, monkeypatch, capsys):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    key = tmp_path / "signing.pem"
    assert main(["audit", "keygen", "--out", str(key)]) == 0
    config = write_workspace(tmp_path, auth=False)
    config.write_text(config.read_text() + "audit: {checkpoint_every: 2, anchors: {dir: digests, every_s: 0.05}}\n")
    monkeypatch.setenv("INFERLINE_AUDIT__SIGNING_KEY_FILE", str(key))
    digests = tmp_path / "digests"
    with TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))) \
            as client:
        for n in range(4):
            assert client.post("/pipelines/chat", json={"input": f"q{n}?"}).status_code == 200
        deadline = time.monotonic() + 10
        while len(list(digests.glob("*.json"))) < 2:
            assert time.monotonic() < deadline, "no digests delivered"
            time.sleep(0.05)
        assert 'inferline_audit_anchor_deliveries_total{result="ok",target="file"}' in client.get("/metrics").text
    monkeypatch.delenv("INFERLINE_AUDIT__SIGNING_KEY_FILE")  # the reviewer: no secret, the public key only
    capsys.readouterr()
    common = ["audit", "verify", "--config", str(config), "--public-key", str(key) + ".pub", "--anchors", str(digests)]
    assert main(common) == 0
    out = capsys.readouterr().out
    assert "anchors ok: 2 digest(s), the newest of seq 4" in out and "not checked" not in out
    cut_tail(make_engine(f"sqlite:///{tmp_path / 'keys.db'}"), 2)
    assert main(common) == 1
    out = capsys.readouterr().out
    assert out.startswith("ok: 2 record(s) checked")  # the database agrees with itself...
    assert "tail_cut: seq 3" in out and "(the database alone does not show this)" in out  # ...not with the digests


def test_a_key_that_is_not_one_stops_the_server(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    monkeypatch.setenv("INFERLINE_AUDIT__SIGNING_KEY", "not a key")
    with pytest.raises(SpecError, match=r"audit\.signing_key: not an unencrypted PEM private key"):
        create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine()))


# --- the newest records (issue 58) ------------------------------------------------------


def serving(config) -> TestClient:
    return TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris."))))


def wait_for(path, what: str) -> None:
    deadline = time.monotonic() + 10
    while not path.exists():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def fresh_env(monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_AUDIT__SIGNING_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)


def test_the_default_server_signs_and_anchors_beside_its_database(tmp_path, fresh_env, capsys):
    config = write_workspace(tmp_path, auth=False)  # no key, no anchors configured: the defaults
    with serving(config) as client:
        for n in range(8):
            assert client.post("/pipelines/chat", json={"input": f"q{n}?"}).status_code == 200
    key = tmp_path / "keys-audit-signing.pem"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600 and (tmp_path / "keys-audit-signing.pem.pub").exists()
    assert (tmp_path / "keys-audit-digests" / f"{8:020d}.json").exists()  # the last round, at shutdown
    plain = ["audit", "verify", "--config", str(config)]  # a reviewer: the config, nothing else
    capsys.readouterr()
    assert main(plain) == 0
    out = capsys.readouterr().out
    assert "anchors ok" in out and "the newest of seq 8" in out and "not checked" not in out
    cut_tail(make_engine(f"sqlite:///{tmp_path / 'keys.db'}"), 3)  # the five newest, their checkpoints, the head
    assert main(plain) == 1
    out = capsys.readouterr().out
    assert out.startswith("ok: 3 record(s) checked") and "tail_cut: seq 4" in out


def test_the_newest_records_are_anchored_within_the_window(tmp_path, fresh_env, monkeypatch, capsys):
    key = tmp_path / "signing.pem"
    assert main(["audit", "keygen", "--out", str(key)]) == 0
    config = write_workspace(tmp_path, auth=False)
    # As the issue had it: a checkpoint every 5 records, digests every 2 s (checkpoint_every_s: its default, 2).
    config.write_text(config.read_text() + "audit: {checkpoint_every: 5, anchors: {dir: digests, every_s: 2}}\n")
    monkeypatch.setenv("INFERLINE_AUDIT__SIGNING_KEY_FILE", str(key))
    digests = tmp_path / "digests"
    with serving(config) as client:
        for n in range(3):
            assert client.post("/pipelines/chat", json={"input": f"q{n}?"}).status_code == 200
        wait_for(digests / f"{3:020d}.json", "seq 3, no multiple of 5, was never anchored")
        for n in range(3, 8):
            assert client.post("/pipelines/chat", json={"input": f"q{n}?"}).status_code == 200
        wait_for(digests / f"{8:020d}.json", "the five newest records were not anchored within the window")
    monkeypatch.delenv("INFERLINE_AUDIT__SIGNING_KEY_FILE")
    cut_tail(make_engine(f"sqlite:///{tmp_path / 'keys.db'}"), 3)
    capsys.readouterr()
    assert main(["audit", "verify", "--config", str(config), "--public-key", f"{key}.pub",
                 "--anchors", str(digests)]) == 1
    out = capsys.readouterr().out
    assert "tail_cut: seq 4" in out and "(the database alone does not show this)" in out


def test_records_written_without_the_key_are_named_until_a_server_signs_them(tmp_path, fresh_env, capsys):
    config = write_workspace(tmp_path, auth=False)
    with serving(config) as client:
        assert client.post("/pipelines/chat", json={"input": "q?"}).status_code == 200
    # What `inferline run` or `inferline audit erase` append while no server runs: no key, no checkpoint.
    engine = make_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    keyless = AuditStore(engine, spool_path=tmp_path / "run.spool")
    for _ in range(3):
        keyless.write({"pipeline": "chat", "status": "ok"})
    plain = ["audit", "verify", "--config", str(config)]
    capsys.readouterr()
    assert main(plain) == 0  # within the window: a note, not a finding
    out = capsys.readouterr().out
    assert "note: the last 3 record(s) (seq 2..4), written in the last" in out
    assert "are not yet covered by a signed checkpoint" in out and "are not yet anchored" in out
    hour_ago = datetime.now(UTC) - timedelta(hours=1)
    keyless.write({"pipeline": "chat", "status": "ok", "received_at": hour_ago, "completed_at": hour_ago})
    assert main(plain) == 1
    out = capsys.readouterr().out
    assert "missing_checkpoint: seq 2 record None: seq 2..5: 4 record(s), the oldest written 60 min ago" in out
    with serving(config):  # the server's first round signs the head, whoever wrote it
        pass
    assert main(plain) == 0
    out = capsys.readouterr().out
    assert "note" not in out and "the newest of seq 5" in out


def test_the_verify_api_names_the_records_no_checkpoint_covers_yet(tmp_path, fresh_env):
    config = write_workspace(tmp_path, auth=False)
    config.write_text(config.read_text() + "audit: {checkpoint_every_s: 3600}\n")  # no round but the first
    with serving(config) as client:
        for n in range(2):
            assert client.post("/pipelines/chat", json={"input": f"q{n}?"}).status_code == 200
        verdict = client.get("/audit/verify").json()
    assert verdict["ok"] and verdict["uncovered"]["first_seq"] == 1 and verdict["uncovered"]["count"] == 2
