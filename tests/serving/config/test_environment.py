"""Environment overrides and secrets from files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.errors import SpecError
from serving.config.environment import NOT_SETTINGS, PREFIX, apply_environment
from serving.config.server import ServerSpec

ROOT = Path(__file__).parents[3]


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


def test_variables_that_are_not_settings_leave_the_server_alone():
    """A client's key or the engine's knobs exported in the shell that starts a server: the server starts."""
    env = {f"{PREFIX}{name}": "1" for name in NOT_SETTINGS}
    assert apply_environment(ServerSpec(), env) == ServerSpec()


def test_every_inferline_variable_the_code_reads_is_a_setting_or_named_as_not_one(tmp_path):
    """Each ``INFERLINE_*`` name in the code either overrides a setting or is in NOT_SETTINGS: one the
    server took for a setting would refuse to start where it is exported ("no setting ... to override")."""
    names = set()
    for folder in ("serving", "pipeline", "stages", "store"):
        for path in [*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.h"), *(ROOT / folder).rglob("*.cpp")]:
            names |= set(re.findall(r"\bINFERLINE_([A-Z][A-Z0-9_]*[A-Z0-9])\b", path.read_text()))
    assert names >= {"API_KEY", "SMALL_ROWS", "CALIBRATION_CACHE", "POOL_SPIN_US"}  # the scan finds them
    value = tmp_path / "value"
    value.write_text("1")
    for name in sorted(names - NOT_SETTINGS):
        try:
            apply_environment(ServerSpec(), {f"{PREFIX}{name}": str(value) if name.endswith("_FILE") else "1"})
        except SpecError as exc:
            pytest.fail(f"{PREFIX}{name}: {exc}")
        except ValueError:
            pass  # a setting, given a value of the wrong type


def test_text_settings_keep_values_that_yaml_would_read_as_numbers():
    """A key of digits only is text, as written: YAML alone would make it the number 123 (leading zero
    lost) and the setting would refuse it; a numeric setting still gets its number."""
    server = apply_environment(ServerSpec(), {"INFERLINE_AUDIT__CHECKPOINT_KEY": "0123",
                                              "INFERLINE_PORT": "8001"})
    assert server.audit.checkpoint_key == "0123" and server.http.port == 8001
    with pytest.raises(ValueError, match=r"http\.port"):
        apply_environment(ServerSpec(), {"INFERLINE_AUDIT__CHECKPOINT_KEY": "0123", "INFERLINE_PORT": "many"})
