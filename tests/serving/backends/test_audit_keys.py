"""The key a server makes for itself beside a SQLite database, as sshd makes host keys, and where its
digests go (serving/backends/audit_keys.py)."""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline.errors import SpecError
from serving.backends.audit_keys import anchor_folder, exposure_window_s, local_key, serving_signer
from serving.config.audit import AnchorsSpec, AuditSpec
from serving.config.server import ServerSpec
from store.audit import Ed25519Signer, load_or_create, load_public_key


def server(**audit: object) -> ServerSpec:
    return ServerSpec(audit=AuditSpec(**audit))


def test_a_key_is_made_once_beside_the_database_mode_600_with_its_public_key(tmp_path):
    url = f"sqlite:///{tmp_path / 'inferline.db'}"
    signer = serving_signer(server(), url)
    key, public = tmp_path / "inferline-audit-signing.pem", tmp_path / "inferline-audit-signing.pem.pub"
    assert isinstance(signer, Ed25519Signer) and stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert load_public_key(public.read_bytes()) == signer.public_key
    assert (tmp_path / "inferline-audit-digests").is_dir()
    assert serving_signer(server(), url).key_id == signer.key_id  # the next start reads it
    assert anchor_folder(server(), tmp_path / "config", url) == tmp_path / "inferline-audit-digests"


def test_processes_starting_together_end_up_with_one_key(tmp_path):
    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: load_or_create(tmp_path / "k.pem"), range(8)))
    assert len({signer.key_id for signer, _ in made}) == 1 and [fresh for _, fresh in made].count(True) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["k.pem", "k.pem.pub"]  # no staged file left


@pytest.mark.parametrize("url", ["postgresql+psycopg://u@h/db", "sqlite:///:memory:", "sqlite://"])
def test_no_key_of_its_own_without_a_sqlite_file(url):
    assert local_key(server(), url) is None and serving_signer(server(), url) is None


def test_a_configured_key_or_local_key_off_makes_none(tmp_path):
    url = f"sqlite:///{tmp_path / 'inferline.db'}"
    assert local_key(server(checkpoint_key="k"), url) is None and local_key(server(local_key=False), url) is None
    assert serving_signer(server(checkpoint_key="k"), url).algorithm == "hmac-sha256"
    assert list(tmp_path.iterdir()) == []
    configured = server(anchors=AnchorsSpec(dir="digests", every_s=1))
    assert anchor_folder(configured, tmp_path, url) == tmp_path / "digests"
    assert exposure_window_s(configured) == 3.0 and exposure_window_s(server()) == 4.0


def test_a_key_file_that_is_not_one_or_a_lone_public_key_stops_the_server(tmp_path):
    url = f"sqlite:///{tmp_path / 'inferline.db'}"
    key = Path(tmp_path / "inferline-audit-signing.pem")
    key.write_text("not a key")
    with pytest.raises(SpecError, match=r"audit\.local_key: .*inferline-audit-signing\.pem: not an unencrypted PEM"):
        serving_signer(server(), url)
    key.unlink()
    key.with_name(key.name + ".pub").write_text("an older key's public half")
    with pytest.raises(SpecError, match=r"missing, though its public key inferline-audit-signing\.pem\.pub is there"):
        serving_signer(server(), url)  # never a new key that would leave the old checkpoints unverifiable
    assert not key.exists()
