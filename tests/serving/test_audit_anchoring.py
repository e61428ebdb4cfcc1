"""A server that signs its checkpoints with Ed25519 and delivers each as a digest file; a reviewer
who holds only the public key verifies the database against the digests (``inferline audit``)."""

from __future__ import annotations

import os
import stat
import time

import pytest
from litestar.testing import TestClient

from pipeline.errors import SpecError
from serving.cli.main import main
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.db import make_engine
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import write_workspace
from tests.store.test_audit_anchors import cut_tail


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
