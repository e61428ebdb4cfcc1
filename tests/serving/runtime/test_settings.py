"""Environment overrides and secrets from files."""

from __future__ import annotations

import pytest

from pipeline.errors import SpecError
from pipeline.spec import ServerSpec
from serving.runtime.settings import apply_environment


def test_overrides_by_path_and_alias():
    server = apply_environment(ServerSpec(), {
        "INFERLINE_DATABASE": "postgresql+psycopg://u@127.0.0.1/db",
        "INFERLINE_PORT": "8001", "INFERLINE_HTTP__HOST": "127.0.0.2",
        "INFERLINE_AUTH__ENABLED": "false", "INFERLINE_TELEMETRY__EXPORTER": "console",
        "INFERLINE_CONFIG": "ignored.yaml", "PATH": "/bin",
    })
    assert server.database == "postgresql+psycopg://u@127.0.0.1/db"
    assert (server.http.port, server.http.host) == (8001, "127.0.0.2")
    assert server.auth.enabled is False and server.telemetry.exporter == "console"


def test_secret_from_file(tmp_path):
    secret = tmp_path / "key"
    secret.write_text("s3cret\n")
    server = apply_environment(ServerSpec(), {"INFERLINE_AUDIT__CHECKPOINT_KEY_FILE": str(secret)})
    assert server.audit.checkpoint_key == "s3cret"


@pytest.mark.parametrize(("env", "message"), [
    ({"INFERLINE_DATABSE": "x"}, "no setting 'databse'"),
    ({"INFERLINE_PORT": "many"}, "http.port"),
    ({"INFERLINE_DATABASE_FILE": "/no/such/file"}, "cannot read /no/such/file"),
])
def test_bad_overrides_are_clear(env, message):
    with pytest.raises((SpecError, ValueError), match=message):
        apply_environment(ServerSpec(), env)


def test_no_overrides_is_the_same_object():
    server = ServerSpec()
    assert apply_environment(server, {}) is server
